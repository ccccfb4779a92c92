//! The gate of a connection: what comes before its Hello is served.
//!
//! A unit with a shared secret serves a connection only after a
//! challenge–response ([`stowage_wire::auth`]): the client's
//! [`Request::Auth`] is answered with a [`Response::Challenge`] (the unit's
//! fresh nonce and its own proof), and only a right [`Request::Prove`]
//! lets the Hello through — before it no session exists, nothing is read
//! or released, and no fd is handed over. Anything else first (a Hello
//! without a proof, a wrong proof, garbage) is refused with
//! `Unauthorized`, and the connection closes. A unit without a secret lets
//! the Hello through at once and refuses an Auth (a client that holds a
//! secret must not talk to a unit that cannot prove it).
//!
//! [`Gate`] is a pure state machine over decoded frames, so that the
//! connection loop (`conn.rs`) and the `handshake` fuzz target drive
//! the same code.

use stowage_wire::auth::{Nonce, Secret};
use stowage_wire::{ErrorCode, Request, Response, WireError};

/// Said to a client that did not prove the secret.
pub const NEEDS_SECRET: &str = "this unit needs the shared secret: connect with the units' secret (STOWAGE_SECRET or --secret-file)";
/// Said to a client whose proof was wrong.
pub const WRONG_SECRET: &str = "wrong proof of the shared secret: this unit needs the shared secret, and the client's is not the unit's";
/// Said to a client that offers a handshake to a unit without a secret.
pub const NO_SECRET: &str =
    "this unit runs without a secret; a client that holds one does not connect to it";
/// Said to a client whose first request is not Hello.
pub const HELLO_FIRST: &str = "the first request must be Hello";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing received yet.
    Start,
    /// The challenge was sent.
    Challenged {
        client_nonce: Nonce,
        unit_nonce: Nonce,
    },
    /// The client proved the secret: the next request must be Hello.
    Proven,
    /// The Hello went through: every request is served.
    Open,
    /// Refused: the connection is being closed.
    Closed,
}

/// What the gate makes of a frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Send this reply, then read the next frame.
    Reply(Response),
    /// Send nothing; read the next frame (a right proof: the client sends
    /// its Hello without waiting).
    Next,
    /// Serve this request: the Hello that opens the gate, or any request
    /// once it is open.
    Serve(Request),
    /// Send this error and close the connection.
    Refuse(Response),
}

/// The handshake state of one connection.
pub struct Gate {
    secret: Option<Secret>,
    state: State,
}

fn refuse(code: ErrorCode, message: impl Into<String>) -> Verdict {
    Verdict::Refuse(Response::Error {
        code,
        message: message.into(),
    })
}

impl Gate {
    /// The gate of a new connection to a unit with `secret` (or none).
    pub fn new(secret: Option<Secret>) -> Gate {
        Gate {
            secret,
            state: State::Start,
        }
    }

    /// Whether the Hello went through: later requests skip the gate.
    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// Whether the client proved the secret (always false without one).
    pub fn proven(&self) -> bool {
        self.secret.is_some() && matches!(self.state, State::Proven | State::Open)
    }

    /// Whether the gate refused the connection.
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// Take one frame: `frame` is the decoded and validated request, or
    /// why it could not be had. `nonce` draws the unit's nonce (called
    /// only for an Auth).
    pub fn step(
        &mut self,
        frame: Result<Request, WireError>,
        nonce: impl FnOnce() -> std::io::Result<Nonce>,
    ) -> Verdict {
        let v = self.decide(frame, nonce);
        if matches!(v, Verdict::Refuse(_)) {
            self.state = State::Closed;
        }
        v
    }

    fn decide(
        &mut self,
        frame: Result<Request, WireError>,
        nonce: impl FnOnce() -> std::io::Result<Nonce>,
    ) -> Verdict {
        let Some(secret) = &self.secret else {
            // No secret: Hello first, as ever.
            return match (self.state, frame) {
                (State::Closed, _) => refuse(ErrorCode::Unauthorized, "the connection is closed"),
                (State::Open, Ok(Request::Hello { .. })) => refuse(
                    ErrorCode::InvalidRequest,
                    "Hello was already said on this connection",
                ),
                (State::Open, Ok(req)) => Verdict::Serve(req),
                (_, Err(e)) => refuse(ErrorCode::InvalidRequest, e.to_string()),
                (_, Ok(req @ Request::Hello { .. })) => {
                    self.state = State::Open;
                    Verdict::Serve(req)
                }
                (_, Ok(Request::Auth { .. } | Request::Prove { .. })) => {
                    refuse(ErrorCode::Unauthorized, NO_SECRET)
                }
                (_, Ok(_)) => refuse(ErrorCode::Unauthorized, HELLO_FIRST),
            };
        };
        match (self.state, frame) {
            (State::Closed, _) => refuse(ErrorCode::Unauthorized, "the connection is closed"),
            (State::Open, Ok(Request::Hello { .. })) => refuse(
                ErrorCode::InvalidRequest,
                "Hello was already said on this connection",
            ),
            (State::Open, Ok(req)) => Verdict::Serve(req),
            (State::Open, Err(e)) => refuse(ErrorCode::InvalidRequest, e.to_string()),
            (State::Start, Ok(Request::Auth { client_nonce })) => {
                let unit_nonce = match nonce() {
                    Ok(n) => n,
                    Err(e) => return refuse(ErrorCode::Internal, format!("no random nonce: {e}")),
                };
                let unit_proof = secret.unit_proof(&client_nonce, &unit_nonce);
                self.state = State::Challenged {
                    client_nonce,
                    unit_nonce,
                };
                Verdict::Reply(Response::Challenge {
                    unit_nonce,
                    unit_proof,
                })
            }
            (
                State::Challenged {
                    client_nonce,
                    unit_nonce,
                },
                Ok(Request::Prove { client_proof }),
            ) => {
                if secret.verify_client_proof(&client_nonce, &unit_nonce, &client_proof) {
                    self.state = State::Proven;
                    Verdict::Next
                } else {
                    refuse(ErrorCode::Unauthorized, WRONG_SECRET)
                }
            }
            (State::Proven, Ok(req @ Request::Hello { .. })) => {
                self.state = State::Open;
                Verdict::Serve(req)
            }
            // Proven, but the frame is not a valid Hello.
            (State::Proven, Err(e)) => refuse(ErrorCode::InvalidRequest, e.to_string()),
            (State::Proven, Ok(_)) => refuse(ErrorCode::Unauthorized, HELLO_FIRST),
            // Anything else before the proof: a Hello without one, a
            // second Auth, a Prove before the challenge, garbage.
            (State::Start | State::Challenged { .. }, _) => {
                refuse(ErrorCode::Unauthorized, NEEDS_SECRET)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_wire::PROTOCOL_VERSION;

    fn secret(s: &str) -> Secret {
        Secret::from_bytes(s.as_bytes()).unwrap()
    }

    fn hello() -> Request {
        Request::Hello {
            version: PROTOCOL_VERSION,
            namespace: "ns".into(),
            want_fd: true,
            session: None,
        }
    }

    fn is_refused(v: &Verdict, code: ErrorCode) -> bool {
        matches!(v, Verdict::Refuse(Response::Error { code: c, .. }) if *c == code)
    }

    /// Auth with `client_nonce`; returns the challenge.
    fn challenge(g: &mut Gate, client_nonce: Nonce, unit_nonce: Nonce) -> (Nonce, [u8; 32]) {
        match g.step(Ok(Request::Auth { client_nonce }), || Ok(unit_nonce)) {
            Verdict::Reply(Response::Challenge {
                unit_nonce,
                unit_proof,
            }) => (unit_nonce, unit_proof),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_right_secret_opens_the_gate_and_the_unit_proves_it_too() {
        let s = secret("a secret of thirty-two bytes....");
        let mut g = Gate::new(Some(s.clone()));
        let c = [1u8; 32];
        let (u, up) = challenge(&mut g, c, [2; 32]);
        assert!(s.verify_unit_proof(&c, &u, &up), "the unit proves it too");
        let v = g.step(
            Ok(Request::Prove {
                client_proof: s.client_proof(&c, &u),
            }),
            || unreachable!(),
        );
        assert_eq!(v, Verdict::Next);
        assert!(g.proven() && !g.is_open());
        assert_eq!(
            g.step(Ok(hello()), || unreachable!()),
            Verdict::Serve(hello())
        );
        assert!(g.is_open());
        assert_eq!(
            g.step(Ok(Request::Stats), || unreachable!()),
            Verdict::Serve(Request::Stats)
        );
    }

    #[test]
    fn a_wrong_secret_a_missing_proof_or_garbage_is_refused() {
        let s = secret("a secret of thirty-two bytes....");
        let wrong = secret("another secret, thirty-two bytes");
        // Wrong secret.
        let mut g = Gate::new(Some(s.clone()));
        let c = [1u8; 32];
        let (u, up) = challenge(&mut g, c, [2; 32]);
        assert!(
            !wrong.verify_unit_proof(&c, &u, &up),
            "the client refuses this unit"
        );
        let v = g.step(
            Ok(Request::Prove {
                client_proof: wrong.client_proof(&c, &u),
            }),
            || unreachable!(),
        );
        assert!(is_refused(&v, ErrorCode::Unauthorized), "{v:?}");
        assert!(g.is_closed());
        // Once refused, always refused (even a right proof).
        let v = g.step(
            Ok(Request::Prove {
                client_proof: s.client_proof(&c, &u),
            }),
            || unreachable!(),
        );
        assert!(is_refused(&v, ErrorCode::Unauthorized));
        // No handshake: Hello, Stats, a Prove before the challenge, garbage.
        for first in [
            Ok(hello()),
            Ok(Request::Stats),
            Ok(Request::Prove {
                client_proof: [0; 32],
            }),
            Err(WireError::Truncated),
        ] {
            let mut g = Gate::new(Some(s.clone()));
            let v = g.step(first, || unreachable!());
            assert_eq!(
                v,
                Verdict::Refuse(Response::Error {
                    code: ErrorCode::Unauthorized,
                    message: NEEDS_SECRET.into()
                })
            );
        }
        // Challenged, then Hello without a proof, or a second Auth.
        for next in [hello(), Request::Auth { client_nonce: c }] {
            let mut g = Gate::new(Some(s.clone()));
            challenge(&mut g, c, [2; 32]);
            assert!(is_refused(
                &g.step(Ok(next), || Ok([3; 32])),
                ErrorCode::Unauthorized
            ));
        }
        // Proven, then something other than Hello.
        let mut g = Gate::new(Some(s.clone()));
        let (u, _) = challenge(&mut g, c, [2; 32]);
        g.step(
            Ok(Request::Prove {
                client_proof: s.client_proof(&c, &u),
            }),
            || unreachable!(),
        );
        assert!(is_refused(
            &g.step(Ok(Request::Stats), || unreachable!()),
            ErrorCode::Unauthorized
        ));
    }

    #[test]
    fn a_recorded_proof_fails_on_a_new_connection_and_a_reflected_one_fails() {
        let s = secret("a secret of thirty-two bytes....");
        let c = [1u8; 32];
        let mut first = Gate::new(Some(s.clone()));
        let (u1, up1) = challenge(&mut first, c, [2; 32]);
        let recorded = s.client_proof(&c, &u1);
        // A new connection: the same client nonce, a fresh unit nonce.
        let mut second = Gate::new(Some(s.clone()));
        challenge(&mut second, c, [9; 32]);
        let v = second.step(
            Ok(Request::Prove {
                client_proof: recorded,
            }),
            || unreachable!(),
        );
        assert!(is_refused(&v, ErrorCode::Unauthorized), "replayed: {v:?}");
        // The unit's own proof sent back as the client's.
        let mut third = Gate::new(Some(s.clone()));
        let (_, up3) = challenge(&mut third, c, [2; 32]);
        assert_eq!(up3, up1);
        let v = third.step(Ok(Request::Prove { client_proof: up3 }), || unreachable!());
        assert!(is_refused(&v, ErrorCode::Unauthorized), "reflected: {v:?}");
    }

    #[test]
    fn without_a_secret_hello_comes_first_and_auth_is_refused() {
        let mut g = Gate::new(None);
        assert_eq!(
            g.step(Ok(hello()), || unreachable!()),
            Verdict::Serve(hello())
        );
        assert!(g.is_open() && !g.proven());
        let v = g.step(Ok(hello()), || unreachable!());
        assert!(is_refused(&v, ErrorCode::InvalidRequest));
        let mut g = Gate::new(None);
        let v = g.step(
            Ok(Request::Auth {
                client_nonce: [0; 32],
            }),
            || unreachable!(),
        );
        assert_eq!(
            v,
            Verdict::Refuse(Response::Error {
                code: ErrorCode::Unauthorized,
                message: NO_SECRET.into()
            })
        );
        let mut g = Gate::new(None);
        assert!(is_refused(
            &g.step(Ok(Request::Stats), || unreachable!()),
            ErrorCode::Unauthorized
        ));
        let mut g = Gate::new(None);
        assert!(is_refused(
            &g.step(Err(WireError::Truncated), || unreachable!()),
            ErrorCode::InvalidRequest
        ));
    }
}
