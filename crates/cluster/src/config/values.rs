//! How the config file writes values that TOML has no type for: sizes,
//! durations, page modes (the `#[serde(with = ...)]` of [`super::Config`]'s
//! fields).

/// Sizes: ints (bytes) or strings; written back as ints.
pub(super) mod size {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Str(String),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "expected a size: bytes (an int) or e.g. \"512MiB\" or \"4GiB\"",
            )
        })? {
            Raw::Int(n) => u64::try_from(n)
                .map_err(|_| serde::de::Error::custom(format!("a size cannot be negative ({n})"))),
            Raw::Str(s) => stowage_config::parse_size(&s).map_err(serde::de::Error::custom),
        }
    }

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*v)
    }
}

/// Page modes: their names (`auto`, `hugetlb`, `thp`, `4k`).
pub(super) mod huge_pages {
    use serde::{Deserialize, Deserializer, Serializer};
    use stowage_config::HugePages;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<HugePages, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }

    pub fn serialize<S: Serializer>(v: &HugePages, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }
}

/// Durations: strings such as "30s"; a bare number is refused (seconds or
/// milliseconds?).
pub(super) mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Str(String),
            Other(toml::Value),
        }
        match Raw::deserialize(d)? {
            Raw::Str(s) => stowage_config::parse_duration(&s).map_err(serde::de::Error::custom),
            Raw::Other(v) => Err(serde::de::Error::custom(format!(
                "expected a duration string such as \"30s\", \"500ms\" or \"2m\", got {v}"
            ))),
        }
    }

    pub fn serialize<S: Serializer>(v: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*v))
    }
}

pub(super) mod opt_size {
    use serde::{Deserializer, Serializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        super::size::deserialize(d).map(Some)
    }

    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_u64(*n),
            None => s.serialize_none(),
        }
    }
}

pub(super) mod opt_duration {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        super::duration::deserialize(d).map(Some)
    }

    pub fn serialize<S: Serializer>(v: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(d) => super::duration::serialize(d, s),
            None => s.serialize_none(),
        }
    }
}
