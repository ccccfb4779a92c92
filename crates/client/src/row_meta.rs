//! What the unit keeps beside each value of a row put by the rows API
//! (`put.rs`): its dtype and shape and, for a string-keyed row, the name
//! it was put under (or that name's digest), which reads compare with the
//! name asked for (`rows`' module docs: string keys whose hashes collide);
//! the checks of a put's fields and row names.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

#[cfg(test)]
use crate::values::NAME_BIT;
use crate::values::{DType, RowKey};
use crate::{Client, Error, Result};

/// The reserved field that holds a string row key's text.
pub const KEY_FIELD: &str = "\0key";

/// With copies, a row put on a unit the caller named (not its own, nor
/// its group's) has an empty field of this prefix and the unit's index,
/// so that a repair, and a unit writing a checkpoint, find which unit's
/// rows it is ([`stowage_wire::home_unit`]).
pub(crate) use stowage_wire::UNIT_FIELD_PREFIX;

/// Names up to this many bytes are stored beside each of their row's
/// values; a longer name is stored there as a digest (see the module
/// docs), which keeps every value's metadata well under the unit's limit.
pub const MAX_TAGGED_NAME: usize = 512;

/// Seed of the digest of long names: apart from the row id's (seed 0).
const DIGEST_SEED: u64 = 0x0053_544f_5741_4745; // "STOWAGE"

/// What the unit keeps beside each value. For a value of a string-keyed
/// row a [`PutName`] follows it in the same metadata bytes (index rows'
/// metadata is this alone, as it was before owners were recorded).
#[derive(Serialize, Deserialize)]
pub(crate) struct ValueMeta {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
}

/// The name a value of a string-keyed row was put under.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum PutName<'a> {
    Name(&'a str),
    /// A name longer than [`MAX_TAGGED_NAME`], by its digest.
    Digest(u128),
}

impl PutName<'_> {
    pub(crate) fn of(name: &str) -> PutName<'_> {
        if name.len() <= MAX_TAGGED_NAME {
            PutName::Name(name)
        } else {
            PutName::Digest(digest(name))
        }
    }
}

pub(crate) fn digest(name: &str) -> u128 {
    xxhash_rust::xxh3::xxh3_128_with_seed(name.as_bytes(), DIGEST_SEED)
}

/// Whether a value may be handed out as `key`'s.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ownership {
    Mine,
    /// Put before owners were recorded: check the row's [`KEY_FIELD`].
    Unknown,
    /// Another name's (`None`: known by digest only).
    Other(Option<String>),
}

#[inline]
pub(crate) fn ownership(key: &RowKey, owner: Option<PutName>) -> Ownership {
    // Index rows and string rows never share ids (NAME_BIT).
    let RowKey::Name(name) = key else {
        return Ownership::Mine;
    };
    match owner {
        None => Ownership::Unknown,
        Some(PutName::Name(n)) if n == *name => Ownership::Mine,
        Some(PutName::Name(n)) => Ownership::Other(Some(n.to_owned())),
        Some(PutName::Digest(d)) if name.len() > MAX_TAGGED_NAME && d == digest(name) => {
            Ownership::Mine
        }
        Some(PutName::Digest(_)) => Ownership::Other(None),
    }
}

pub(crate) fn collision(partition: &str, requested: &RowKey, stored: Option<String>) -> Error {
    Error::KeyCollision {
        partition: partition.to_owned(),
        requested: requested.to_string(),
        stored,
    }
}

/// The metadata of a value of `dtype` and `shape` in a row named `owner`.
///
/// One allocation of the metadata's size: a put encodes this for every
/// value it writes, so neither the shape nor a growing buffer is copied.
pub(crate) fn encode_meta(dtype: DType, shape: &[u64], owner: Option<&[u8]>) -> Result<Vec<u8>> {
    let owner = owner.unwrap_or_default();
    // At most: a varint of the dtype's index, of the shape's length and of
    // each dimension (postcard: 10 bytes a u64 at most).
    let cap = 10 * (2 + shape.len()) + owner.len();
    let mut meta = postcard::to_extend(&ValueMetaRef { dtype, shape }, Vec::with_capacity(cap))
        .map_err(|e| Error::InvalidRequest(format!("value metadata: {e}")))?;
    meta.extend_from_slice(owner);
    Ok(meta)
}

/// [`ValueMeta`] over a borrowed shape: the same bytes (serde writes a
/// slice as it writes a Vec).
#[derive(Serialize)]
struct ValueMetaRef<'a> {
    dtype: DType,
    shape: &'a [u64],
}

/// [`decode_meta_into`] a new shape.
#[cfg(test)]
pub(crate) fn decode_meta_shape(
    meta: &[u8],
) -> std::result::Result<(DType, crate::views::Shape, Option<PutName<'_>>), String> {
    let mut shape = crate::views::Shape::new();
    let (dtype, owner) = decode_meta_into(meta, &mut shape)?;
    Ok((dtype, shape, owner))
}

/// [`decode_meta`] for views of thousands of values: the dimensions
/// inline, in `shape` (cleared first) where the caller keeps them,
/// read straight from postcard's bytes (a varint of the dtype's index, of
/// the number of dimensions, of each); the owner, when there is one, as
/// `decode_meta` reads it. Accepts and refuses what `decode_meta` does
/// (the tests compare them on arbitrary bytes).
#[inline]
pub(crate) fn decode_meta_into<'m>(
    meta: &'m [u8],
    shape: &mut crate::views::Shape,
) -> std::result::Result<(DType, Option<PutName<'m>>), String> {
    let bad = || "value metadata unreadable: not put by the rows API?".to_string();
    let mut rest = meta;
    let tag = varint(&mut rest, 5).ok_or_else(bad)?;
    let dtype = usize::try_from(tag)
        .ok()
        .and_then(|i| DType::ALL.get(i))
        .copied()
        .ok_or_else(bad)?;
    let ndim = varint(&mut rest, 10).ok_or_else(bad)?;
    // Each dimension takes a byte at least: more than the bytes left is
    // malformed (and no allocation is sized by it).
    if ndim > rest.len() as u64 {
        return Err(bad());
    }
    shape.clear();
    for _ in 0..ndim {
        shape.push(varint(&mut rest, 10).ok_or_else(bad)?);
    }
    if rest.is_empty() {
        return Ok((dtype, None));
    }
    let (owner, rest) = postcard::take_from_bytes::<PutName>(rest)
        .map_err(|e| format!("value metadata unreadable ({e}): not put by the rows API?"))?;
    if !rest.is_empty() {
        return Err("value metadata has trailing bytes: not put by the rows API?".into());
    }
    Ok((dtype, Some(owner)))
}

/// A postcard varint of at most `max` bytes (5: a u32, 10: a u64) off the
/// front of `bytes`; `None` when it is cut short, longer, or holds more
/// bits than its type (as postcard refuses them).
#[inline]
fn varint(bytes: &mut &[u8], max: usize) -> Option<u64> {
    let bits = if max == 5 { 32 } else { 64 };
    let mut v = 0u64;
    for i in 0..max {
        let b = *bytes.get(i)?;
        let shift = 7 * i as u32;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            if i == max - 1 && u32::from(b) >> (bits - shift) != 0 {
                return None;
            }
            *bytes = &bytes[i + 1..];
            return Some(v);
        }
    }
    None
}

pub(crate) fn decode_meta(
    meta: &[u8],
) -> std::result::Result<(ValueMeta, Option<PutName<'_>>), String> {
    let bad =
        |e: postcard::Error| format!("value metadata unreadable ({e}): not put by the rows API?");
    let (m, rest) = postcard::take_from_bytes::<ValueMeta>(meta).map_err(bad)?;
    if rest.is_empty() {
        return Ok((m, None));
    }
    let (owner, rest) = postcard::take_from_bytes::<PutName>(rest).map_err(bad)?;
    if !rest.is_empty() {
        return Err("value metadata has trailing bytes: not put by the rows API?".into());
    }
    Ok((m, Some(owner)))
}

/// Refuse two different names of one call that share a row id (a put of
/// both would leave one row holding both).
pub(crate) fn check_distinct_rows(
    partition: &str,
    keys: &[RowKey],
    row_id: impl Fn(&RowKey) -> Result<u64>,
) -> Result<()> {
    let mut names: HashMap<u64, &str> = HashMap::new();
    for key in keys {
        if let RowKey::Name(n) = key {
            match names.insert(row_id(key)?, n) {
                Some(other) if other != n => {
                    return Err(collision(partition, key, Some(other.to_owned())))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

pub(crate) fn check_field(f: &str) -> Result<()> {
    if f.is_empty() || f.starts_with('\0') {
        return Err(Error::InvalidRequest(format!(
            "field name {f:?} is empty or reserved (starts with NUL)"
        )));
    }
    Ok(())
}

impl Client {
    pub(crate) fn unit_of_key(&self, row_id: u64, unit: Option<usize>) -> Result<usize> {
        match unit {
            Some(u) if u < self.units.len() => Ok(u),
            Some(u) => Err(Error::InvalidRequest(format!(
                "unit {u} does not exist ({} units)",
                self.units.len()
            ))),
            None => Ok(self.unit_of_row(row_id)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str) -> Vec<u8> {
        postcard::to_allocvec(&PutName::of(name)).unwrap()
    }

    /// The shared home rule places a named row, and a group, where the
    /// client's own ids put them (`Client::unit_of`: the row id modulo
    /// the units).
    #[test]
    fn the_wires_home_rule_is_the_clients_placement() {
        for units in 1..9 {
            for name in ["a", "row-17", "grp/3"] {
                let id = RowKey::Name(name.into()).row_id().unwrap();
                let own = (id % units as u64) as usize;
                assert_eq!(stowage_wire::home_unit(id, [KEY_FIELD, "v"], units), own);
                let group = format!("{}{name}", stowage_wire::GROUP_FIELD_PREFIX);
                assert_eq!(stowage_wire::home_unit(5, ["v", &group], units), own);
            }
            let on = format!("{UNIT_FIELD_PREFIX}{}", units - 1);
            assert_eq!(stowage_wire::home_unit(0, ["v", &on], units), units - 1);
        }
    }

    #[test]
    fn index_rows_keep_the_metadata_they_always_had() {
        let meta = encode_meta(DType::F32, &[3, 4], None).unwrap();
        let before = postcard::to_allocvec(&ValueMeta {
            dtype: DType::F32,
            shape: vec![3, 4],
        })
        .unwrap();
        assert_eq!(meta, before);
        let (m, owner) = decode_meta(&meta).unwrap();
        assert_eq!((m.dtype, m.shape, owner), (DType::F32, vec![3, 4], None));
    }

    #[test]
    fn values_of_string_rows_carry_their_name() {
        let meta = encode_meta(DType::I64, &[7], Some(&named("uid_g3"))).unwrap();
        let (m, owner) = decode_meta(&meta).unwrap();
        assert_eq!((m.dtype, m.shape), (DType::I64, vec![7]));
        assert_eq!(owner, Some(PutName::Name("uid_g3")));
        let long = "x".repeat(MAX_TAGGED_NAME + 1);
        let meta = encode_meta(DType::I64, &[7], Some(&named(&long))).unwrap();
        assert_eq!(
            decode_meta(&meta).unwrap().1,
            Some(PutName::Digest(digest(&long)))
        );
        // Trailing garbage is not taken for an owner.
        let mut bad = meta.clone();
        bad.push(0);
        assert!(decode_meta(&bad).is_err());
    }

    fn both_decoders(meta: &[u8]) -> Option<(DType, Vec<u64>, Option<PutName<'_>>)> {
        let by_serde = decode_meta(meta).ok().map(|(m, o)| (m.dtype, m.shape, o));
        let by_hand = decode_meta_shape(meta)
            .ok()
            .map(|(d, s, o)| (d, s.to_vec(), o));
        assert_eq!(by_hand, by_serde, "{meta:?}");
        by_hand
    }

    #[test]
    fn inline_shapes_decode_as_vectors_do() {
        let shapes = [
            vec![],
            vec![7],
            vec![2, 3, 4, 5],
            vec![1, 2, 3, 4, 5, 6],
            vec![u64::MAX, 0, 1 << 35],
        ];
        for dtype in DType::ALL {
            for shape in &shapes {
                for owner in [
                    None,
                    Some(named("uid_g3")),
                    Some(named(&"x".repeat(MAX_TAGGED_NAME + 1))),
                ] {
                    let meta = encode_meta(dtype, shape, owner.as_deref()).unwrap();
                    let (d, s, _) = both_decoders(&meta).unwrap();
                    assert_eq!((d, &s), (dtype, shape));
                }
            }
        }
        let mut bad = encode_meta(DType::I64, &[7], None).unwrap();
        bad.push(0);
        assert!(both_decoders(&bad).is_none());
        assert!(both_decoders(&[]).is_none());
        // Padded varints read as postcard reads them; overflowing ones
        // are refused.
        assert!(both_decoders(&[0x84, 0x80, 0x80, 0x80, 0x00, 0]).is_some());
        assert!(both_decoders(&[0x80, 0x80, 0x80, 0x80, 0x10, 0]).is_none());
        assert!(
            both_decoders(&[4, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02])
                .is_none()
        );
        assert!(
            both_decoders(&[4, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01])
                .is_some()
        );
        // A dtype index past the last.
        assert!(both_decoders(&[13, 0]).is_none());
    }

    proptest::proptest! {
        #[test]
        fn the_inline_decoder_reads_what_serde_reads(meta in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24)) {
            both_decoders(&meta);
        }

        #[test]
        fn the_inline_decoder_reads_what_was_written(
            dtype in 0..13usize,
            shape in proptest::collection::vec(proptest::prelude::any::<u64>(), 0..8),
            name in proptest::option::of("[a-z]{0,12}"),
        ) {
            let owner = name.as_deref().map(named);
            let meta = encode_meta(DType::ALL[dtype], &shape, owner.as_deref()).unwrap();
            let (d, s, o) = both_decoders(&meta).unwrap();
            proptest::prop_assert_eq!((d, s), (DType::ALL[dtype], shape));
            proptest::prop_assert_eq!(o, name.as_deref().map(PutName::of));
        }
    }

    #[test]
    fn the_longest_tagged_name_fits_the_units_metadata_limit() {
        let name = "n".repeat(MAX_TAGGED_NAME);
        let shape = [u64::MAX; 32];
        let meta = encode_meta(DType::F64, &shape, Some(&named(&name))).unwrap();
        assert!(meta.len() <= stowage_wire::Limits::default().max_meta);
    }

    #[test]
    fn only_the_owner_gets_a_value() {
        let a = RowKey::Name("a".into());
        fn own(n: &str) -> Option<PutName<'_>> {
            Some(PutName::of(n))
        }
        assert_eq!(ownership(&a, own("a")), Ownership::Mine);
        assert_eq!(ownership(&a, own("b")), Ownership::Other(Some("b".into())));
        assert_eq!(ownership(&a, None), Ownership::Unknown);
        // Index rows never share ids with string rows.
        assert_eq!(ownership(&RowKey::Index(3), None), Ownership::Mine);
        // Long names by digest, both ways.
        let (l1, l2) = ("p".repeat(600), "q".repeat(600));
        let k1 = RowKey::Name(l1.clone());
        assert_eq!(ownership(&k1, own(&l1)), Ownership::Mine);
        assert_eq!(ownership(&k1, own(&l2)), Ownership::Other(None));
        assert_eq!(ownership(&k1, own("a")), Ownership::Other(Some("a".into())));
        assert_eq!(ownership(&a, own(&l1)), Ownership::Other(None));
        // A digest never matches a short name, not even its own digest.
        let digest_of_a = Some(PutName::Digest(digest("a")));
        assert_eq!(ownership(&a, digest_of_a), Ownership::Other(None));
    }

    #[test]
    fn one_put_naming_two_colliding_names_is_refused() {
        // Every name hashes alike here.
        let same = |k: &RowKey| match k {
            RowKey::Name(_) => Ok(NAME_BIT | 1),
            RowKey::Index(i) => Ok(*i),
        };
        let keys = [
            RowKey::Index(1),
            RowKey::Name("a".into()),
            RowKey::Name("a".into()),
        ];
        check_distinct_rows("p", &keys, same).unwrap();
        let keys = [RowKey::Name("a".into()), RowKey::Name("b".into())];
        assert_eq!(
            check_distinct_rows("p", &keys, same),
            Err(Error::KeyCollision {
                partition: "p".into(),
                requested: "b".into(),
                stored: Some("a".into()),
            })
        );
        check_distinct_rows("p", &keys, RowKey::row_id).unwrap();
    }
}
