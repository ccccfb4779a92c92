//! The unit's handshake gate (`stowage_unit::auth::Gate`): sequences of
//! frames on a series of connections to one unit, with or without a
//! shared secret. Frames are arbitrary bytes through the frame decoder
//! (with the handshake's limits, as the connection loop reads them) and
//! `Request::validate`, or well-formed handshake messages: Auth with any
//! nonce, the right proof, a proof under another secret, arbitrary proof
//! bytes, a proof recorded on an earlier connection (replay), the unit's
//! own proof sent back (reflection), Hello, and other requests.
//!
//! After every step the target checks (and panics on a violation):
//!
//! 1. with a secret, a request is served only after a Prove that carried
//!    exactly the client proof for this connection's two nonces, and the
//!    first one served is a Hello; without a secret, the first served is a
//!    Hello and Auth/Prove are refused `Unauthorized`;
//! 2. a right proof is never refused; a recorded proof passes on a later
//!    connection only if the unit's nonce repeated, a reflected one never;
//! 3. a challenge answers only an Auth, and its proof checks out under the
//!    secret for the client's nonce (and is not the client's proof);
//! 4. once refused, a connection stays refused; every refusal is an error
//!    frame, `Unauthorized` before the proof (with a secret);
//! 5. no reply or error message contains the secret;
//! 6. no panic.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use stowage_unit::auth::{Gate, Verdict};
use stowage_wire::auth::{Nonce, Proof, Secret};
use stowage_wire::{decode_frame, ErrorCode, Limits, Request, Response, PROTOCOL_VERSION};

const SECRET: &[u8] = b"the fuzz target's secret, 32 b.!";

#[derive(Arbitrary, Debug)]
struct Input {
    with_secret: bool,
    /// The unit nonces the gate draws, in turn (cycled; zeros if none):
    /// small, so that they repeat.
    unit_nonces: Vec<u8>,
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// Bytes from the wire, decoded as the connection loop decodes them.
    Raw(Vec<u8>),
    Auth {
        nonce: u8,
    },
    AuthRaw {
        nonce: [u8; 32],
    },
    /// The right proof for this connection's challenge (if there was one).
    ProveRight,
    /// The proof under another secret.
    ProveWrong {
        salt: u8,
    },
    ProveRaw {
        proof: [u8; 32],
    },
    /// A right proof captured on an earlier connection.
    ProveRecorded {
        which: u8,
    },
    /// The unit's own proof of this connection, sent back.
    ProveReflected,
    Hello {
        want_fd: bool,
        version: u16,
    },
    Stats,
    ClearRows {
        row: u64,
    },
    /// The connection ends; the next step is on a new one.
    Reconnect,
}

fn nonce_of(b: u8) -> Nonce {
    let mut n = [0u8; 32];
    n[0] = b;
    n[31] = b.wrapping_mul(7);
    n
}

struct Conn {
    gate: Gate,
    /// (client nonce, unit nonce, unit proof) of the challenge sent.
    challenge: Option<(Nonce, Nonce, Proof)>,
    /// A Prove with the right proof was answered Next.
    proven: bool,
    /// The gate let a request through.
    served: bool,
    refused: bool,
}

struct H {
    /// Events seen, for `HS_STATS` (see fuzz/README.md).
    seen: std::collections::BTreeMap<&'static str, u32>,
    secret: Option<Secret>,
    nonces: Vec<u8>,
    drawn: usize,
    conn: Conn,
    /// Right proofs sent on earlier connections, with their nonces.
    recorded: Vec<(Nonce, Nonce, Proof)>,
}

impl H {
    fn new_conn(secret: &Option<Secret>) -> Conn {
        Conn {
            gate: Gate::new(secret.clone()),
            challenge: None,
            proven: false,
            served: false,
            refused: false,
        }
    }

    fn right(&self) -> Option<Proof> {
        let s = self.secret.as_ref()?;
        let (c, u, _) = self.conn.challenge?;
        Some(s.client_proof(&c, &u))
    }

    fn step(&mut self, step: Step) {
        let frame: Result<Request, stowage_wire::WireError> = match step {
            Step::Reconnect => {
                self.conn = Self::new_conn(&self.secret);
                return;
            }
            Step::Raw(bytes) => {
                match decode_frame::<Request>(&bytes, &Limits::default().handshake()) {
                    // More bytes needed: the connection would wait for them
                    // (and be cut at the deadline).
                    Ok(None) => return,
                    Ok(Some((f, _))) => {
                        let req = f.envelope.body;
                        req.validate(&Limits::default().handshake()).map(|()| req)
                    }
                    Err(e) => Err(e),
                }
            }
            Step::Auth { nonce } => Ok(Request::Auth {
                client_nonce: nonce_of(nonce),
            }),
            Step::AuthRaw { nonce } => Ok(Request::Auth {
                client_nonce: nonce,
            }),
            Step::ProveRight => Ok(Request::Prove {
                client_proof: self.right().unwrap_or([0; 32]),
            }),
            Step::ProveWrong { salt } => {
                let mut k = SECRET.to_vec();
                k[0] ^= salt | 1;
                let wrong = Secret::from_bytes(k).expect("long enough");
                let (c, u) = self
                    .conn
                    .challenge
                    .map_or(([0; 32], [0; 32]), |(c, u, _)| (c, u));
                Ok(Request::Prove {
                    client_proof: wrong.client_proof(&c, &u),
                })
            }
            Step::ProveRaw { proof } => Ok(Request::Prove {
                client_proof: proof,
            }),
            Step::ProveRecorded { which } => {
                let Some(&(_, _, p)) = self
                    .recorded
                    .get(which as usize % self.recorded.len().max(1))
                else {
                    return;
                };
                Ok(Request::Prove { client_proof: p })
            }
            Step::ProveReflected => Ok(Request::Prove {
                client_proof: self.conn.challenge.map_or([0; 32], |(_, _, p)| p),
            }),
            Step::Hello { want_fd, version } => Ok(Request::Hello {
                version: if version % 4 == 0 {
                    version
                } else {
                    PROTOCOL_VERSION
                },
                namespace: "ns".into(),
                want_fd,
                session: None,
            }),
            Step::Stats => Ok(Request::Stats),
            Step::ClearRows { row } => Ok(Request::ClearRows {
                partition: String::new(),
                rows: vec![row],
            }),
        };
        let right = self.right();
        let sent = frame.as_ref().map(|r| r.clone()).map_err(|_| ());
        let nonces = &self.nonces;
        let drawn = &mut self.drawn;
        let mut asked = false;
        let verdict = self.conn.gate.step(frame, || {
            asked = true;
            let b = if nonces.is_empty() {
                0
            } else {
                nonces[*drawn % nonces.len()]
            };
            *drawn += 1;
            Ok(nonce_of(b))
        });
        self.check(sent, verdict, right, asked);
    }

    fn check(
        &mut self,
        sent: Result<Request, ()>,
        verdict: Verdict,
        right: Option<Proof>,
        asked: bool,
    ) {
        let event = match (&verdict, self.secret.is_some()) {
            (Verdict::Refuse(_), _) if matches!(sent, Ok(Request::Prove { .. })) => "refused_proof",
            (Verdict::Refuse(_), _) => "refused",
            (Verdict::Reply(_), _) => "challenge",
            (Verdict::Next, _) => "proof_taken",
            (Verdict::Serve(_), true) => "served_with_secret",
            (Verdict::Serve(_), false) => "served_without_secret",
        };
        *self.seen.entry(event).or_default() += 1;
        let c = &mut self.conn;
        // 4. Once refused, always refused.
        if c.refused {
            assert!(
                matches!(verdict, Verdict::Refuse(_)),
                "a refused connection went on: {verdict:?}"
            );
            return;
        }
        // 5. No secret in anything the unit says.
        let said = match &verdict {
            Verdict::Reply(r) | Verdict::Refuse(r) => Some(r),
            _ => None,
        };
        if let Some(Response::Error { message, .. }) = said {
            assert!(
                !message
                    .as_bytes()
                    .windows(SECRET.len())
                    .any(|w| w == SECRET),
                "the secret in an error message"
            );
        }
        match (&self.secret, verdict) {
            (_, Verdict::Refuse(r)) => {
                assert!(
                    matches!(r, Response::Error { .. }),
                    "a refusal that is no error: {r:?}"
                );
                if let (Some(_), false) = (&self.secret, c.proven) {
                    assert!(
                        matches!(
                            r,
                            Response::Error {
                                code: ErrorCode::Unauthorized | ErrorCode::Internal,
                                ..
                            }
                        ),
                        "refused before the proof with {r:?}"
                    );
                }
                // 2. A right proof is never refused.
                if let (Ok(Request::Prove { client_proof }), Some(right)) = (&sent, right) {
                    assert!(
                        !(c.challenge.is_some() && !c.proven && *client_proof == right),
                        "a right proof was refused"
                    );
                }
                if self.secret.is_none() {
                    if let Ok(Request::Auth { .. } | Request::Prove { .. }) = &sent {
                        assert!(matches!(
                            r,
                            Response::Error {
                                code: ErrorCode::Unauthorized,
                                ..
                            }
                        ));
                    }
                }
                if let Ok(Request::Prove { client_proof }) = &sent {
                    if self.recorded.iter().any(|r| r.2 == *client_proof) {
                        *self.seen.entry("replayed_proof_refused").or_default() += 1;
                    }
                    if c.challenge.is_some_and(|(_, _, up)| up == *client_proof) {
                        *self.seen.entry("reflected_proof_refused").or_default() += 1;
                    }
                }
                c.refused = true;
            }
            (None, Verdict::Reply(r)) => panic!("a unit without a secret replied {r:?}"),
            (None, Verdict::Next) => panic!("a unit without a secret took a proof"),
            (None, Verdict::Serve(req)) => {
                // 1. Without a secret: Hello first.
                if !c.served {
                    assert!(
                        matches!(req, Request::Hello { .. }),
                        "served {req:?} before Hello"
                    );
                }
                assert_eq!(
                    Ok(&req),
                    sent.as_ref(),
                    "served something else than was sent"
                );
                c.served = true;
            }
            (Some(s), Verdict::Reply(r)) => {
                // 3. A challenge answers an Auth, and proves the secret.
                let Ok(Request::Auth { client_nonce }) = sent else {
                    panic!("{r:?} in reply to {sent:?}");
                };
                let Response::Challenge {
                    unit_nonce,
                    unit_proof,
                } = r
                else {
                    panic!("{r:?} in reply to Auth");
                };
                assert!(asked, "a challenge without a fresh nonce");
                assert!(
                    c.challenge.is_none(),
                    "a second challenge on one connection"
                );
                assert!(s.verify_unit_proof(&client_nonce, &unit_nonce, &unit_proof));
                assert_ne!(unit_proof, s.client_proof(&client_nonce, &unit_nonce));
                c.challenge = Some((client_nonce, unit_nonce, unit_proof));
            }
            (Some(_), Verdict::Next) => {
                // 1, 2. Only the right proof, once, after a challenge.
                let Ok(Request::Prove { client_proof }) = sent else {
                    panic!("Next in reply to {sent:?}");
                };
                assert!(!c.proven, "a second proof taken");
                let (cn, un, up) = c.challenge.expect("a proof taken before any challenge");
                assert_eq!(Some(client_proof), right, "a wrong proof taken");
                assert_ne!(client_proof, up, "a reflected proof taken");
                // A recorded proof passes only where the nonces repeated.
                for (rc, ru, rp) in &self.recorded {
                    if *rp == client_proof {
                        assert!(*rc == cn && *ru == un, "a replayed proof taken");
                        *self
                            .seen
                            .entry("replayed_proof_taken_same_nonces")
                            .or_default() += 1;
                    }
                }
                c.proven = true;
                self.recorded.push((cn, un, client_proof));
                if self.recorded.len() > 8 {
                    self.recorded.remove(0);
                }
            }
            (Some(_), Verdict::Serve(req)) => {
                // 1. Nothing before the proof; Hello first.
                assert!(c.proven, "served {req:?} without a proof");
                if !c.served {
                    assert!(
                        matches!(req, Request::Hello { .. }),
                        "served {req:?} before Hello"
                    );
                }
                assert_eq!(
                    Ok(&req),
                    sent.as_ref(),
                    "served something else than was sent"
                );
                c.served = true;
            }
        }
        assert_eq!(c.gate.is_closed(), c.refused);
        assert_eq!(c.gate.is_open(), c.served && !c.refused);
        assert_eq!(c.gate.proven(), c.proven && !c.refused);
    }
}

fuzz_target!(|input: Input| {
    let secret = input
        .with_secret
        .then(|| Secret::from_bytes(SECRET).expect("long enough"));
    let mut h = H {
        seen: Default::default(),
        conn: H::new_conn(&secret),
        secret,
        nonces: input.unit_nonces,
        drawn: 0,
        recorded: Vec::new(),
    };
    for step in input.steps.into_iter().take(256) {
        h.step(step);
    }
    static STATS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *STATS.get_or_init(|| std::env::var_os("HS_STATS").is_some()) {
        let line: Vec<String> = h.seen.iter().map(|(k, v)| format!("{k}={v}")).collect();
        eprintln!("HS {}", line.join(" "));
    }
});
