//! The one timer an actor shell needs: armed for the earliest deadline its core reports
//! (`poll_timeout`), re-armed only when that deadline changes.

use std::time::{Duration, Instant};

use actix::prelude::*;

/// A re-armable deadline timer, held by an actor.
#[derive(Debug, Default)]
pub struct DeadlineTimer {
    handle: Option<SpawnHandle>,
    armed_for: Option<Instant>,
}

impl DeadlineTimer {
    /// Arms the timer for `next` (or disarms it for `None`), unless it is already armed for
    /// that instant. When it fires, `timer(actor)` is reset and `fire` runs with the time.
    pub fn arm<A>(
        &mut self,
        ctx: &mut Context<A>,
        next: Option<Instant>,
        timer: fn(&mut A) -> &mut DeadlineTimer,
        fire: fn(&mut A, Instant, &mut Context<A>),
    ) where
        A: Actor<Context = Context<A>>,
    {
        if next == self.armed_for {
            return;
        }
        if let Some(handle) = self.handle.take() {
            ctx.cancel_future(handle);
        }
        self.armed_for = next;
        if let Some(at) = next {
            // A millisecond late rather than early: a deadline is never seen as not yet due.
            let after = at.saturating_duration_since(Instant::now()) + Duration::from_millis(1);
            self.handle = Some(ctx.run_later(after, move |act, ctx| {
                *timer(act) = DeadlineTimer::default();
                fire(act, Instant::now(), ctx);
            }));
        }
    }
}
