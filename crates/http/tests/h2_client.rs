//! ebb's HTTP/2 client side ([`ebb_http::h2client`]) against the `h2` crate's server, over an
//! in-memory pipe: many requests at once on one connection, bodies larger than every window
//! both ways (the server's windows are the default 65,535 bytes), and trailers after each
//! answer, as a gRPC server sends them.

use std::collections::HashMap;

use bytes::Bytes;
use ebb_http::h2client::{Client, Config, Event};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

/// Serves one connection: each request's body comes back whole, with its path in `x-path` and
/// trailers saying how long it was.
async fn echo_server(io: DuplexStream) {
    let mut conn = h2::server::handshake(io).await.unwrap();
    while let Some(accepted) = conn.accept().await {
        let Ok((req, mut respond)) = accepted else {
            return;
        };
        tokio::spawn(async move {
            let path = req.uri().path().to_owned();
            let mut body = req.into_body();
            let mut whole = Vec::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.unwrap();
                body.flow_control().release_capacity(chunk.len()).unwrap();
                whole.extend_from_slice(&chunk);
            }
            let answer = http::Response::builder()
                .status(200)
                .header("x-path", path)
                .body(())
                .unwrap();
            let mut send = respond.send_response(answer, false).unwrap();
            let mut left = Bytes::from(whole);
            let length = left.len().to_string();
            while !left.is_empty() {
                send.reserve_capacity(left.len());
                let cap = std::future::poll_fn(|cx| send.poll_capacity(cx))
                    .await
                    .unwrap()
                    .unwrap();
                let part = left.split_to(cap.min(left.len()));
                send.send_data(part, false).unwrap();
            }
            let mut trailers = http::HeaderMap::new();
            trailers.insert("x-length", length.parse().unwrap());
            send.send_trailers(trailers).unwrap();
        });
    }
}

/// What came back for one request: status, `x-path`, body, `x-length` from the trailers.
#[derive(Debug, Default, PartialEq, Eq)]
struct Answer {
    status: u16,
    path: Vec<u8>,
    body: Vec<u8>,
    length: Vec<u8>,
}

/// Sends every request at once on one connection (POST `path` with `body`), each body as the
/// windows let it, and reads the answers.
async fn exchange(io: DuplexStream, requests: Vec<(String, Vec<u8>)>) -> Vec<Answer> {
    let (mut rd, mut wr) = tokio::io::split(io);
    // The server's bytes are read all the time, so its writes never wait for this side's.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    tokio::spawn(async move {
        let mut chunk = vec![0; 64 * 1024];
        loop {
            match rd.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send(chunk[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut client = Client::new(Config::default());
    let mut index = HashMap::new();
    let mut unsent: HashMap<u32, (usize, Vec<u8>)> = HashMap::new();
    let mut answers: Vec<Answer> = requests.iter().map(|_| Answer::default()).collect();
    for (i, (path, body)) in requests.into_iter().enumerate() {
        let stream = client
            .request(b"POST", b"http", b"app.test", path.as_bytes(), [], false)
            .unwrap();
        index.insert(stream, i);
        unsent.insert(stream, (0, body));
    }
    let mut done = 0;
    let mut buf = Vec::new();
    let mut events = Vec::new();
    while done < answers.len() {
        unsent.retain(|&stream, (sent, body)| {
            let n = client.send_data(stream, &body[*sent..], true).unwrap();
            *sent += n;
            *sent < body.len()
        });
        let out = std::mem::take(client.out());
        wr.write_all(&out).await.unwrap();
        let bytes = rx.recv().await.expect("the server closed the connection");
        buf.extend_from_slice(&bytes);
        let used = client.recv(&buf, &mut events).unwrap();
        for e in events.drain(..) {
            match e {
                Event::Response { stream, head, .. } => {
                    let a = &mut answers[index[&stream]];
                    a.status = head.status;
                    a.path = head
                        .fields
                        .into_iter()
                        .find(|(n, _)| n == b"x-path")
                        .map(|(_, v)| v)
                        .unwrap_or_default();
                }
                Event::Data { stream, data, .. } => {
                    answers[index[&stream]]
                        .body
                        .extend_from_slice(&buf[data.clone()]);
                    client.consumed(stream, data.len());
                }
                Event::Trailers { stream, fields } => {
                    answers[index[&stream]].length = fields
                        .into_iter()
                        .find(|(n, _)| n == b"x-length")
                        .map(|(_, v)| v)
                        .unwrap_or_default();
                    done += 1;
                }
                Event::Reset { stream, code } => panic!("stream {stream} reset: {code}"),
                Event::GoAway { code, .. } => panic!("GOAWAY {code}"),
                Event::Writable { .. } => {}
            }
        }
        buf.drain(..used);
    }
    assert_eq!(client.open_streams(), 0);
    answers
}

#[tokio::test]
async fn many_requests_at_once_come_back_whole_with_their_trailers() {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    tokio::spawn(echo_server(theirs));
    let requests: Vec<(String, Vec<u8>)> = (0..100)
        .map(|i| (format!("/r/{i}"), vec![i as u8; i * 37]))
        .collect();
    let answers = exchange(ours, requests.clone()).await;
    for ((path, body), a) in requests.iter().zip(&answers) {
        assert_eq!(a.status, 200);
        assert_eq!(a.path, path.as_bytes());
        assert_eq!(&a.body, body, "{path}");
        assert_eq!(a.length, body.len().to_string().as_bytes());
    }
}

#[tokio::test]
async fn bodies_larger_than_every_window_go_both_ways() {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    tokio::spawn(echo_server(theirs));
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let requests = vec![
        ("/a".to_owned(), big.clone()),
        ("/b".to_owned(), big.clone()),
        ("/c".to_owned(), big.clone()),
    ];
    let answers = exchange(ours, requests).await;
    for a in answers {
        assert_eq!(a.status, 200);
        assert_eq!(a.body.len(), big.len());
        assert!(a.body == big);
        assert_eq!(a.length, b"3000000");
    }
}
