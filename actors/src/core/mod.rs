//! The decisions, without I/O: per-peer sessions (transfer phases, ordering, deadlines,
//! whether a peer waited on is still heard),
//! budgets and reservations, route choice and receive matching. Nothing here uses actix,
//! tokio, sockets or a clock; time is a parameter, so a test drives whole scenarios in
//! virtual time.
pub mod budget;
pub mod discovery;
pub mod exports;
pub mod liveness;
pub mod mailroom;
pub mod route;
pub mod session;
