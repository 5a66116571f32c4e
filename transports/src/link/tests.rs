use super::*;
use tokio::io::AsyncReadExt;

#[tokio::test]
async fn write_out_sends_the_buffer_then_every_part_through_short_writes() {
    // A pipe that takes at most 7 bytes at a time, and one slice per write.
    let (write, mut read) = tokio::io::duplex(7);
    let mut write: BoxWrite = Box::new(write);
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        read.read_to_end(&mut got).await.map(|_| got)
    });
    let mut buffer = b"head:".to_vec();
    let parts: [&[u8]; 4] = [b"0123456789", b"", b"abc", b"defghijklmnopqrstu"];
    let wrote = write_out(&mut write, Duration::from_secs(5), &mut buffer, &parts).await;
    assert!(wrote.is_ok(), "{wrote:?}");
    assert!(buffer.is_empty(), "what was buffered left the buffer");
    drop(write);
    match reader.await {
        Ok(Ok(got)) => assert_eq!(got, b"head:0123456789abcdefghijklmnopqrstu"),
        other => panic!("{other:?}"),
    }
}
