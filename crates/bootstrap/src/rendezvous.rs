//! Bounded connect-with-backoff, for SPs reaching their peers.
//!
//! No fixed sleeps: a refused connection (the peer has not bound yet) is retried after a delay
//! that doubles from `initial_delay` up to `max_delay`, until `deadline` has passed; then the
//! last error is returned with the number of attempts.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub initial_delay: Duration,
    pub max_delay: Duration,
    pub deadline: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(500),
            deadline: Duration::from_secs(30),
        }
    }
}

pub fn connect_with_backoff(addr: SocketAddr, b: Backoff) -> std::io::Result<TcpStream> {
    let start = Instant::now();
    let mut delay = b.initial_delay;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let left = b
            .deadline
            .saturating_sub(start.elapsed())
            .max(Duration::from_millis(10));
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => return Ok(s),
            Err(e) if start.elapsed() + delay >= b.deadline => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("cannot connect to {addr} after {attempts} attempts: {e}"),
                ));
            }
            Err(_) => {
                std::thread::sleep(delay);
                delay = (delay * 2).min(b.max_delay);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_up_within_the_deadline() {
        // Bind then drop to find a port that refuses connections.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let b = Backoff {
            initial_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(20),
            deadline: Duration::from_millis(200),
        };
        let t = Instant::now();
        let err = connect_with_backoff(addr, b).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2));
        assert!(err.to_string().contains("attempts"), "{err}");
    }

    #[test]
    fn connects_once_the_peer_listens() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = connect_with_backoff(l.local_addr().unwrap(), Backoff::default()).unwrap();
        assert_eq!(s.peer_addr().unwrap(), l.local_addr().unwrap());
    }
}
