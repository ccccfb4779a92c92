//! A reply's header read with its [`Response::Resolved`] handed over value
//! by value ([`decode_streamed`]): a view of thousands of values builds
//! its own records straight from the bytes, without the reply's
//! `Vec<Option<Placed>>` in between. Any other reply is decoded whole.

use std::fmt;

use serde::de::{DeserializeSeed, EnumAccess, Error as _, SeqAccess, VariantAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::{Envelope, PinId, Response, WireError};

/// A found value of a [`Response::Resolved`] as [`decode_streamed`] hands
/// it over: the fields of [`crate::Placed`], its metadata borrowed from
/// the header's bytes.
#[derive(Debug, PartialEq, Eq, Deserialize)]
pub struct PlacedRef<'a> {
    pub offset: u64,
    pub len: u64,
    pub meta: &'a [u8],
    pub on_disk: bool,
    pub parts: Vec<(u64, u64)>,
}

/// A [`Response::Resolved`] less its values (handed over one by one).
#[derive(Debug, PartialEq, Eq)]
pub struct ResolvedHead {
    pub pin: Option<PinId>,
    /// How many values (found or not) it answered.
    pub found: usize,
    pub corrupt: Vec<u32>,
    pub spares_back: bool,
}

/// What [`decode_streamed`] read.
#[derive(Debug, PartialEq, Eq)]
pub enum Streamed {
    /// A Resolved, whose values went to the caller's function.
    Resolved(ResolvedHead),
    /// Any other reply, whole.
    Other(Response),
}

/// The place of [`Response::Resolved`] among the replies (postcard writes
/// a variant as its index; `resolved_is_the_seventh_reply` checks it).
const RESOLVED: u32 = 6;

/// The error that stops the streamed reading of another reply (which is
/// then decoded whole).
const NOT_RESOLVED: &str = "\0not a Resolved";

/// Decode a reply's header (`Envelope<Response>`, as
/// [`crate::decode_header`] does): a [`Response::Resolved`] hands each of
/// its values to `each` (its position, the value or `None` when not
/// found) in order and comes back as [`Streamed::Resolved`]; any other
/// reply comes back whole. `each` may be called before the header turns
/// out malformed: the caller drops what it built on an error.
pub fn decode_streamed<'a>(
    header: &'a [u8],
    each: &mut dyn FnMut(usize, Option<PlacedRef<'a>>),
) -> Result<Envelope<Streamed>, WireError> {
    let mut de = postcard::Deserializer::from_bytes(header);
    match (EnvelopeSeed { each }).deserialize(&mut de) {
        Ok((id, head)) => {
            if !de.finalize().map_err(malformed)?.is_empty() {
                return Err(WireError::Malformed(
                    "trailing bytes after the header".into(),
                ));
            }
            Ok(Envelope {
                id,
                body: Streamed::Resolved(head),
            })
        }
        Err(postcard::Error::SerdeDeCustom) => {
            // Postcard keeps no message: a custom error is ours (the
            // reply is another one) unless the header is malformed, which
            // the whole decoding says again.
            let env = crate::decode_header::<Response>(header)?;
            Ok(Envelope {
                id: env.id,
                body: Streamed::Other(env.body),
            })
        }
        Err(e) => Err(malformed(e)),
    }
}

fn malformed(e: postcard::Error) -> WireError {
    WireError::Malformed(e.to_string())
}

/// `Envelope { id, body }` whose body must be a Resolved.
struct EnvelopeSeed<'f, 'a> {
    each: &'f mut dyn FnMut(usize, Option<PlacedRef<'a>>),
}

impl<'de: 'a, 'a> DeserializeSeed<'de> for EnvelopeSeed<'_, 'a> {
    type Value = (u64, ResolvedHead);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_struct("Envelope", &["id", "body"], self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for EnvelopeSeed<'_, 'a> {
    type Value = (u64, ResolvedHead);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a reply's envelope")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let id: u64 = seq
            .next_element()?
            .ok_or_else(|| A::Error::invalid_length(0, &self))?;
        let head = seq
            .next_element_seed(BodySeed { each: self.each })?
            .ok_or_else(|| A::Error::invalid_length(1, &"a reply"))?;
        Ok((id, head))
    }
}

struct BodySeed<'f, 'a> {
    each: &'f mut dyn FnMut(usize, Option<PlacedRef<'a>>),
}

impl<'de: 'a, 'a> DeserializeSeed<'de> for BodySeed<'_, 'a> {
    type Value = ResolvedHead;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_enum("Response", &[], self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for BodySeed<'_, 'a> {
    type Value = ResolvedHead;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Resolved reply")
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        let (index, variant): (u32, _) = data.variant()?;
        if index != RESOLVED {
            return Err(A::Error::custom(NOT_RESOLVED));
        }
        variant.struct_variant(
            &["pin", "found", "corrupt", "spares_back"],
            ResolvedVisitor { each: self.each },
        )
    }
}

struct ResolvedVisitor<'f, 'a> {
    each: &'f mut dyn FnMut(usize, Option<PlacedRef<'a>>),
}

impl<'de: 'a, 'a> Visitor<'de> for ResolvedVisitor<'_, 'a> {
    type Value = ResolvedHead;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Resolved reply's fields")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let missing = |i| A::Error::invalid_length(i, &"the 4 fields of a Resolved");
        let pin: Option<PinId> = seq.next_element()?.ok_or_else(|| missing(0))?;
        let found = seq
            .next_element_seed(FoundSeed { each: self.each })?
            .ok_or_else(|| missing(1))?;
        let corrupt: Vec<u32> = seq.next_element()?.ok_or_else(|| missing(2))?;
        let spares_back: bool = seq.next_element()?.ok_or_else(|| missing(3))?;
        Ok(ResolvedHead {
            pin,
            found,
            corrupt,
            spares_back,
        })
    }
}

/// The found values, each handed over as it is read; their count.
struct FoundSeed<'f, 'a> {
    each: &'f mut dyn FnMut(usize, Option<PlacedRef<'a>>),
}

impl<'de: 'a, 'a> DeserializeSeed<'de> for FoundSeed<'_, 'a> {
    type Value = usize;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for FoundSeed<'_, 'a> {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Resolved reply's values")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let mut n = 0;
        while let Some(v) = seq.next_element::<Option<PlacedRef<'de>>>()? {
            (self.each)(n, v);
            n += 1;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{encode, Meta, Placed, PREFIX_LEN};
    use proptest::prelude::*;

    fn header(body: Response) -> Vec<u8> {
        let mut out = Vec::new();
        encode(77, &body, 0, &mut out).unwrap();
        out.split_off(PREFIX_LEN)
    }

    /// What decode_streamed makes of `body`: the values it handed over and
    /// the reply, rebuilt as a Response, which must be `body`.
    fn streamed(body: &Response) -> Response {
        let bytes = header(body.clone());
        let mut values = Vec::new();
        let env = decode_streamed(&bytes, &mut |i, v| {
            assert_eq!(i, values.len());
            values.push(v.map(|p| Placed {
                offset: p.offset,
                len: p.len,
                meta: Meta::from(p.meta),
                on_disk: p.on_disk,
                parts: p.parts,
            }));
        })
        .unwrap();
        assert_eq!(env.id, 77);
        match env.body {
            Streamed::Resolved(h) => {
                assert_eq!(h.found, values.len());
                Response::Resolved {
                    pin: h.pin,
                    found: values,
                    corrupt: h.corrupt,
                    spares_back: h.spares_back,
                }
            }
            Streamed::Other(r) => {
                assert!(values.is_empty());
                r
            }
        }
    }

    #[test]
    fn resolved_is_the_seventh_reply() {
        let r = Response::Resolved {
            pin: None,
            found: vec![],
            corrupt: vec![],
            spares_back: false,
        };
        assert_eq!(postcard::to_stdvec(&r).unwrap()[0] as u32, RESOLVED);
    }

    #[test]
    fn other_replies_come_back_whole() {
        for r in [
            Response::Done,
            Response::OnSocket,
            Response::Cleared { entries: 3 },
            Response::Error {
                code: crate::ErrorCode::Busy,
                message: "x".into(),
            },
        ] {
            assert_eq!(streamed(&r), r);
        }
    }

    #[test]
    fn malformed_headers_are_refused() {
        let good = header(Response::Resolved {
            pin: Some(PinId(9)),
            found: vec![None, None],
            corrupt: vec![],
            spares_back: false,
        });
        for cut in 0..good.len() {
            assert!(
                decode_streamed(&good[..cut], &mut |_, _| {}).is_err(),
                "{cut}"
            );
        }
        let mut long = good.clone();
        long.push(0);
        assert!(decode_streamed(&long, &mut |_, _| {}).is_err());
    }

    fn placed() -> impl Strategy<Value = Option<Placed>> {
        proptest::option::of((
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..40),
            any::<bool>(),
            proptest::collection::vec((any::<u64>(), any::<u64>()), 0..3),
        ))
        .prop_map(|p| {
            p.map(|(offset, len, meta, on_disk, parts)| Placed {
                offset,
                len,
                meta: Meta::from(meta),
                on_disk,
                parts,
            })
        })
    }

    proptest! {
        #[test]
        fn a_streamed_resolved_is_the_decoded_one(
            pin in proptest::option::of(any::<u64>()),
            found in proptest::collection::vec(placed(), 0..20),
            corrupt in proptest::collection::vec(any::<u32>(), 0..3),
            spares_back in any::<bool>(),
        ) {
            let r = Response::Resolved { pin: pin.map(PinId), found, corrupt, spares_back };
            prop_assert_eq!(streamed(&r), r);
        }

        #[test]
        fn arbitrary_bytes_decode_alike(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let whole = crate::decode_header::<Response>(&bytes);
            let mut values = 0;
            let got = decode_streamed(&bytes, &mut |_, _| values += 1);
            match (whole, got) {
                (Ok(w), Ok(g)) => match g.body {
                    Streamed::Other(r) => prop_assert_eq!(r, w.body),
                    Streamed::Resolved(h) => match w.body {
                        Response::Resolved { found, .. } => prop_assert_eq!(found.len(), h.found),
                        other => prop_assert!(false, "streamed a Resolved, whole: {:?}", other),
                    },
                },
                (Err(_), Err(_)) => {}
                (w, g) => prop_assert!(false, "whole {:?}, streamed {:?}", w.map(|_| ()), g.map(|_| ())),
            }
        }
    }
}
