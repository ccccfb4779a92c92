//! Which unit's rows a row is (its *home*), from its id and its fields:
//! the rule every client and unit of a plane shares, so that a unit can
//! write one copy of each row to a checkpoint (`CheckpointHomes` in
//! `stowage-wire`), claim only the rows of the homes it is asked to
//! ([`op::Claim`](crate::op::Claim)'s `homes`), and a client can repair
//! copies (`stowage_client`'s repair).

/// The field a row's group id is written under, after this prefix.
pub const GROUP_FIELD_PREFIX: &str = "\0g:";

/// With copies, a claimed row's consumption by a task is written to every
/// copy of the row as an empty field named this prefix, the row's home,
/// `':'` and the task (`"\0c:3:train"`), so that whichever copy claims the
/// row next knows it consumed ([`op::Claim`](crate::op::Claim)).
pub const CONSUMED_FIELD_PREFIX: &str = "\0c:";

/// With copies, the homes whose rows a unit claims
/// ([`op::Claim`](crate::op::Claim)) or counts
/// ([`op::ClaimStatus`](crate::op::ClaimStatus)): the rows whose
/// [`home_unit`] among `units` units is one of `of`. The client names
/// them: each home is claimed by one unit, the first of its copies that
/// holds all its rows.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Homes {
    pub units: u32,
    pub of: Vec<u32>,
}

impl Homes {
    /// The home of `row` (of `fields`) among these units, when it is one
    /// of [`Homes::of`].
    pub fn home_of<'a>(&self, row: u64, fields: impl IntoIterator<Item = &'a str>) -> Option<u32> {
        if self.units == 0 {
            return None;
        }
        let home = home_unit(row, fields, self.units as usize) as u32;
        self.of.contains(&home).then_some(home)
    }
}

/// The field that marks `home`'s row consumed by `task`
/// ([`CONSUMED_FIELD_PREFIX`]).
pub fn consumed_field(home: u32, task: &str) -> String {
    format!("{CONSUMED_FIELD_PREFIX}{home}:{task}")
}

/// The home and task a [`consumed_field`] names; none for another field.
pub fn consumed_of(field: &str) -> Option<(u32, &str)> {
    let rest = field.strip_prefix(CONSUMED_FIELD_PREFIX)?;
    let (home, task) = rest.split_once(':')?;
    Some((home.parse().ok()?, task))
}

/// With copies, a row put on a unit the caller named (not its own, nor
/// its group's) has an empty field of this prefix followed by the unit's
/// index (`"\0u:3"`): that unit is its home.
pub const UNIT_FIELD_PREFIX: &str = "\0u:";

/// The bit string row names set in their row id (ids of indices lie
/// below it).
const NAME_BIT: u64 = 1 << 63;

/// The unit of a row named `name`, or of the rows of the group `name`,
/// among `units` units: its string row id modulo `units`.
fn unit_of_name(name: &str, units: usize) -> usize {
    ((xxhash_rust::xxh3::xxh3_64(name.as_bytes()) | NAME_BIT) % units as u64) as usize
}

/// The home of row `row` among `units` units, from its `fields` (every
/// field the row has, in any order): the unit a [`UNIT_FIELD_PREFIX`]
/// field names, if it is below `units`; else the unit of the group a
/// [`GROUP_FIELD_PREFIX`] field names; else `row % units`. `units` must
/// be above 0.
pub fn home_unit<'a>(row: u64, fields: impl IntoIterator<Item = &'a str>, units: usize) -> usize {
    assert!(units > 0, "a home among no units");
    let (mut named, mut group) = (None, None);
    for f in fields {
        if let Some(u) = f.strip_prefix(UNIT_FIELD_PREFIX) {
            named = named.or_else(|| u.parse::<usize>().ok());
        } else if let Some(g) = f.strip_prefix(GROUP_FIELD_PREFIX) {
            group = group.or(Some(g));
        }
    }
    named
        .filter(|&u| u < units)
        .or_else(|| group.map(|g| unit_of_name(g, units)))
        .unwrap_or((row % units as u64) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_row_is_its_id_modulo_the_units() {
        assert_eq!(home_unit(0, ["a", "b"], 4), 0);
        assert_eq!(home_unit(7, ["a"], 4), 3);
        assert_eq!(home_unit(7, [], 1), 0);
        let named = xxhash_rust::xxh3::xxh3_64(b"row-x") | NAME_BIT;
        assert_eq!(home_unit(named, ["\0key", "v"], 5), (named % 5) as usize);
    }

    #[test]
    fn a_grouped_row_is_its_groups_unit() {
        let g = "\0g:grp-1";
        let unit = ((xxhash_rust::xxh3::xxh3_64(b"grp-1") | NAME_BIT) % 7) as usize;
        assert_eq!(home_unit(0, ["v", g], 7), unit);
        assert_eq!(home_unit(123, [g], 7), unit);
        // Whatever the row's own id.
        assert!((0..20).all(|row| home_unit(row, [g], 7) == unit));
    }

    #[test]
    fn a_row_on_a_named_unit_is_that_units_first() {
        assert_eq!(home_unit(0, ["v", "\0u:3"], 4), 3);
        // Before its group too, in any order.
        assert_eq!(home_unit(1, ["\0g:grp-1", "\0u:2", "v"], 4), 2);
        assert_eq!(home_unit(1, ["\0u:2", "\0g:grp-1"], 4), 2);
    }

    #[test]
    fn a_named_unit_not_below_the_units_is_ignored() {
        assert_eq!(home_unit(5, ["\0u:4"], 4), 1);
        assert_eq!(home_unit(5, ["\0u:x"], 4), 1);
        let unit = ((xxhash_rust::xxh3::xxh3_64(b"g") | NAME_BIT) % 4) as usize;
        assert_eq!(home_unit(5, ["\0u:9", "\0g:g"], 4), unit);
    }

    #[test]
    fn a_consumed_field_names_its_home_and_task() {
        let f = consumed_field(3, "train:v2");
        assert_eq!(f, "\0c:3:train:v2");
        assert_eq!(consumed_of(&f), Some((3, "train:v2")));
        assert_eq!(consumed_of("\0c:x:train"), None);
        assert_eq!(consumed_of("\0g:3:train"), None);
    }

    #[test]
    #[should_panic]
    fn no_units_is_a_caller_bug() {
        home_unit(0, [], 0);
    }
}
