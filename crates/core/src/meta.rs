//! [`Meta`]: a value's metadata as a read hands it on — from the index to
//! the unit's reply, and from the reply to the client — without an
//! allocation per value.

use std::fmt;

use serde::de::{Error as _, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tinyvec::TinyVec;

/// Bytes kept inline: the rows API's dtype and shape, and a short row
/// name, fit.
const INLINE: usize = 32;

/// A value's metadata bytes (opaque to the unit): inline up to 32 bytes,
/// on the heap beyond. Encoded as a `Vec<u8>` is (postcard: a varint
/// length, then the bytes), so a field of this type keeps its message's
/// bytes; a read of thousands of values allocates nothing per value for
/// it. Inline bytes are a whole array (`tinyvec`): a copy moves it in a
/// few wide stores (a byte-wise copy then moved whole stalls on store
/// forwarding, which showed in the profile of a resolve of thousands).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Meta(TinyVec<[u8; INLINE]>);

impl Meta {
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }

    pub fn to_vec(&self) -> Vec<u8> {
        self.0.to_vec()
    }
}

impl std::ops::Deref for Meta {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl From<&[u8]> for Meta {
    fn from(b: &[u8]) -> Self {
        Meta(TinyVec::from(b))
    }
}

impl From<Vec<u8>> for Meta {
    fn from(v: Vec<u8>) -> Self {
        if v.len() <= INLINE {
            Meta::from(&v[..])
        } else {
            Meta(TinyVec::Heap(v))
        }
    }
}

impl fmt::Debug for Meta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0[..].fmt(f)
    }
}

impl Serialize for Meta {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Meta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Bytes;
        impl<'de> Visitor<'de> for Bytes {
            type Value = Meta;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("metadata bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<Meta, E> {
                Ok(Meta::from(b))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, b: Vec<u8>) -> Result<Meta, E> {
                Ok(Meta::from(b))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Meta, A::Error> {
                let mut m = TinyVec::new();
                while let Some(b) = seq.next_element::<u8>()? {
                    m.push(b);
                }
                Ok(Meta(m))
            }
        }
        d.deserialize_bytes(Bytes).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes of a `Vec<u8>` field, both ways, at every length around
    /// the inline limit.
    #[test]
    fn encodes_as_a_vec_of_bytes() {
        for len in [0, 1, 31, 32, 33, 200] {
            let v: Vec<u8> = (0..len).map(|i| i as u8 ^ 0x5a).collect();
            let as_vec = postcard::to_stdvec(&v).unwrap();
            let m = Meta::from(&v[..]);
            assert_eq!(postcard::to_stdvec(&m).unwrap(), as_vec);
            let back: Meta = postcard::from_bytes(&as_vec).unwrap();
            assert_eq!(&back[..], &v[..]);
            let back: Vec<u8> = postcard::from_bytes(&postcard::to_stdvec(&m).unwrap()).unwrap();
            assert_eq!(back, v);
            // Bytes cut short are refused, as for a Vec.
            assert!(postcard::from_bytes::<Meta>(&as_vec[..as_vec.len() - 1]).is_err());
        }
    }
}
