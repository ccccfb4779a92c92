//! Where a job's storage units go: the clusters a placement names
//! ([`select_clusters`]) and one node per unit over their nodes
//! ([`plan_unit_nodes`]).
//!
//! A job has clusters (its training workers, its inference engines, a
//! teacher model's workers, ...), each registered under a name such as
//! `train`, `inference` or `teacher:<name>`, each with its nodes. A
//! colocated run registers one cluster under two names (`train` and
//! `inference` are the same workers); it is still one cluster.
//!
//! Rules, all deterministic:
//!
//! * **Identity.** Clusters are given as `(name, key)` registrations; two
//!   names with equal keys are one cluster. (The Python layer uses the
//!   object's identity, `is`, as the key.) One name registered for two
//!   different keys is an error.
//! * **Selection.** [`Placement::All`] selects every cluster;
//!   [`Placement::Names`] selects the clusters those names are registered
//!   for (a name listed twice, or two names of one cluster, select it
//!   once). Leaving out one name of a cluster that another listed name
//!   selects excludes nothing: a note in [`Selection::notes`] says so.
//! * **Order.** Selected clusters come in the order of their first
//!   registration, whatever the order of the placement's names. Their
//!   nodes come cluster by cluster, each cluster's in its given order; a
//!   node listed twice (in one cluster, or shared by two selected
//!   clusters) counts once, where it first appears.
//! * **Units.** Unit `i` goes to node `i % n` of those `n` nodes
//!   (round-robin); no count means two units per node.
//! * **Errors.** An empty list of names, a name that is not registered
//!   (the error lists the known names), a job with no clusters, selected
//!   clusters without nodes, and a count of zero.

use std::collections::HashSet;
use std::fmt;
use std::hash::Hash;

use serde::{Deserialize, Serialize};

/// Units per node when no count is given.
pub const DEFAULT_UNITS_PER_NODE: usize = 2;

/// Which clusters hold the units: every one, or those named.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Every cluster of the job (`"all"`).
    #[default]
    All,
    /// The clusters registered under these names (at least one name).
    Names(Vec<String>),
}

impl Placement {
    /// The clusters registered under `names`.
    pub fn names<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Placement::Names(names.into_iter().map(Into::into).collect())
    }

    /// Check the placement itself: a list must name at least one cluster.
    pub fn validate(&self) -> Result<(), PlacementError> {
        match self {
            Placement::Names(n) if n.is_empty() => Err(PlacementError::EmptyPlacement),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::All => f.write_str("\"all\""),
            Placement::Names(names) => write!(f, "[{}]", quoted(names)),
        }
    }
}

/// In a config file: `"all"` or a list of names.
impl<'de> Deserialize<'de> for Placement {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Word(String),
            Names(Vec<String>),
        }
        let expected = "\"all\" or a list of cluster names such as [\"train\", \"inference\"]";
        match Raw::deserialize(d)
            .map_err(|_| serde::de::Error::custom(format!("expected {expected}")))?
        {
            Raw::Word(w) if w == "all" => Ok(Placement::All),
            Raw::Word(w) => Err(serde::de::Error::custom(format!(
                "expected {expected}, got the string {w:?} (a list of one name is [{w:?}])"
            ))),
            Raw::Names(n) if n.is_empty() => {
                Err(serde::de::Error::custom(PlacementError::EmptyPlacement))
            }
            Raw::Names(n) => Ok(Placement::Names(n)),
        }
    }
}

impl Serialize for Placement {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Placement::All => s.serialize_str("all"),
            Placement::Names(n) => n.serialize(s),
        }
    }
}

/// The clusters a placement selects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection<K> {
    /// The selected clusters' keys, each once, in order of first
    /// registration.
    pub clusters: Vec<K>,
    /// Things worth a log line: names the placement left out whose cluster
    /// it selects anyway (through another of its names).
    pub notes: Vec<String>,
}

/// Why no placement could be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("the placement names no cluster: use \"all\" or a non-empty list of cluster names")]
    EmptyPlacement,
    #[error("the job has no clusters to place units on")]
    NoClusters,
    #[error("the placement names cluster {name:?}, which the job does not have (its clusters: {})", quoted(.known))]
    UnknownCluster { name: String, known: Vec<String> },
    #[error("cluster name {name:?} is registered for two different clusters")]
    NameTwice { name: String },
    #[error("the selected clusters have no nodes")]
    NoNodes,
    #[error("a unit count must be at least 1")]
    ZeroCount,
}

/// `"a", "b", "c"`.
fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `"a"`, `"a" and "b"`, `"a", "b" and "c"`.
fn and_list(names: &[&str]) -> String {
    let q: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
    match q.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => q.join(""),
    }
}

/// The clusters `placement` selects out of `clusters_by_name`, the job's
/// `(name, cluster key)` registrations in their order (see the module
/// documentation for identity, order and errors).
pub fn select_clusters<N, K>(
    placement: &Placement,
    clusters_by_name: &[(N, K)],
) -> Result<Selection<K>, PlacementError>
where
    N: AsRef<str>,
    K: Clone + Eq,
{
    placement.validate()?;
    // Distinct clusters in order of first registration, with their names.
    let mut clusters: Vec<(&K, Vec<&str>)> = Vec::new();
    let mut names: Vec<(&str, usize)> = Vec::new();
    for (name, key) in clusters_by_name {
        let name = name.as_ref();
        let idx = match clusters.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                clusters.push((key, Vec::new()));
                clusters.len() - 1
            }
        };
        match names.iter().find(|(n, _)| *n == name) {
            Some((_, i)) if *i == idx => continue,
            Some(_) => {
                return Err(PlacementError::NameTwice {
                    name: name.to_string(),
                })
            }
            None => {}
        }
        names.push((name, idx));
        clusters[idx].1.push(name);
    }
    if clusters.is_empty() {
        return Err(PlacementError::NoClusters);
    }
    let wanted = match placement {
        Placement::All => {
            return Ok(Selection {
                clusters: clusters.into_iter().map(|(k, _)| k.clone()).collect(),
                notes: Vec::new(),
            })
        }
        Placement::Names(wanted) => wanted,
    };
    let mut selected = vec![false; clusters.len()];
    for w in wanted {
        match names.iter().find(|(n, _)| n == w) {
            Some((_, i)) => selected[*i] = true,
            None => {
                return Err(PlacementError::UnknownCluster {
                    name: w.clone(),
                    known: names.iter().map(|(n, _)| n.to_string()).collect(),
                })
            }
        }
    }
    let mut notes = Vec::new();
    for ((_, cluster_names), _) in clusters.iter().zip(&selected).filter(|(_, s)| **s) {
        let (listed, left_out): (Vec<&str>, Vec<&str>) = cluster_names
            .iter()
            .partition(|n| wanted.iter().any(|w| w == *n));
        if !left_out.is_empty() {
            notes.push(format!(
                "{} name one cluster (e.g. a colocated run): the placement selects it through {}, \
                 so leaving out {} excludes nothing",
                and_list(cluster_names),
                and_list(&listed),
                and_list(&left_out),
            ));
        }
    }
    Ok(Selection {
        clusters: clusters
            .into_iter()
            .zip(selected)
            .filter(|(_, s)| *s)
            .map(|((k, _), _)| k.clone())
            .collect(),
        notes,
    })
}

/// The nodes of `clusters`, cluster by cluster, each in its given order,
/// each node once (where it first appears).
pub fn distinct_nodes<C, T>(clusters: &[C]) -> Vec<T>
where
    C: AsRef<[T]>,
    T: Clone + Eq + Hash,
{
    let mut seen = HashSet::new();
    let mut nodes = Vec::new();
    for c in clusters {
        for n in c.as_ref() {
            if seen.insert(n) {
                nodes.push(n.clone());
            }
        }
    }
    nodes
}

/// One node per unit: unit `i` on node `i % n` of the [`distinct_nodes`]
/// of the selected `clusters`; `count` units, or
/// [`DEFAULT_UNITS_PER_NODE`] per node when `None`.
pub fn plan_unit_nodes<C, T>(clusters: &[C], count: Option<usize>) -> Result<Vec<T>, PlacementError>
where
    C: AsRef<[T]>,
    T: Clone + Eq + Hash,
{
    if count == Some(0) {
        return Err(PlacementError::ZeroCount);
    }
    let nodes = distinct_nodes(clusters);
    if nodes.is_empty() {
        return Err(PlacementError::NoNodes);
    }
    let count = count.unwrap_or(DEFAULT_UNITS_PER_NODE * nodes.len());
    Ok((0..count).map(|i| nodes[i % nodes.len()].clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Placement {
        Placement::names(v.iter().copied())
    }

    /// `select_clusters` cases: registrations as (name, cluster number),
    /// the placement, and the clusters expected (or the error), plus the
    /// names each note must mention as left out.
    #[test]
    fn select_clusters_table() {
        struct Case {
            what: &'static str,
            regs: &'static [(&'static str, u32)],
            placement: Placement,
            want: Result<&'static [u32], PlacementError>,
            left_out: &'static [&'static str],
        }
        let known = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cases = vec![
            Case {
                what: "all: every cluster in registration order",
                regs: &[("train", 1), ("inference", 2), ("teacher:big", 3)],
                placement: Placement::All,
                want: Ok(&[1, 2, 3]),
                left_out: &[],
            },
            Case {
                what: "all: aliases are one cluster",
                regs: &[("train", 7), ("inference", 7), ("teacher:t", 3)],
                placement: Placement::All,
                want: Ok(&[7, 3]),
                left_out: &[],
            },
            Case {
                what: "one name",
                regs: &[("train", 1), ("inference", 2)],
                placement: names(&["inference"]),
                want: Ok(&[2]),
                left_out: &[],
            },
            Case {
                what: "order is registration order, not placement order",
                regs: &[("train", 1), ("inference", 2), ("teacher:a", 3)],
                placement: names(&["teacher:a", "train"]),
                want: Ok(&[1, 3]),
                left_out: &[],
            },
            Case {
                what: "a name listed twice selects its cluster once",
                regs: &[("train", 1), ("inference", 2)],
                placement: names(&["train", "train"]),
                want: Ok(&[1]),
                left_out: &[],
            },
            Case {
                what: "both names of a colocated cluster: one cluster, nothing to note",
                regs: &[("train", 1), ("inference", 1), ("teacher:t", 2)],
                placement: names(&["inference", "train"]),
                want: Ok(&[1]),
                left_out: &[],
            },
            Case {
                what: "excluding one name of a colocated cluster excludes nothing",
                regs: &[("train", 1), ("inference", 1), ("teacher:t", 2)],
                placement: names(&["train"]),
                want: Ok(&[1]),
                left_out: &["inference"],
            },
            Case {
                what: "excluding an alias while selecting others",
                regs: &[("train", 1), ("teacher:t", 2), ("inference", 1)],
                placement: names(&["inference", "teacher:t"]),
                want: Ok(&[1, 2]),
                left_out: &["train"],
            },
            Case {
                what: "a cluster under three names",
                regs: &[("a", 5), ("b", 5), ("c", 5)],
                placement: names(&["b"]),
                want: Ok(&[5]),
                left_out: &["a", "c"],
            },
            Case {
                what: "the same registration twice is one",
                regs: &[("train", 1), ("train", 1), ("inference", 2)],
                placement: Placement::All,
                want: Ok(&[1, 2]),
                left_out: &[],
            },
            Case {
                what: "a cluster named all is selected by the list [\"all\"]",
                regs: &[("all", 1), ("train", 2)],
                placement: names(&["all"]),
                want: Ok(&[1]),
                left_out: &[],
            },
            Case {
                what: "unknown name",
                regs: &[("train", 1), ("inference", 2)],
                placement: names(&["train", "trian"]),
                want: Err(PlacementError::UnknownCluster {
                    name: "trian".into(),
                    known: known(&["train", "inference"]),
                }),
                left_out: &[],
            },
            Case {
                what: "names are case-sensitive",
                regs: &[("train", 1)],
                placement: names(&["Train"]),
                want: Err(PlacementError::UnknownCluster {
                    name: "Train".into(),
                    known: known(&["train"]),
                }),
                left_out: &[],
            },
            Case {
                what: "empty list",
                regs: &[("train", 1)],
                placement: names(&[]),
                want: Err(PlacementError::EmptyPlacement),
                left_out: &[],
            },
            Case {
                what: "no clusters, all",
                regs: &[],
                placement: Placement::All,
                want: Err(PlacementError::NoClusters),
                left_out: &[],
            },
            Case {
                what: "no clusters, a name",
                regs: &[],
                placement: names(&["train"]),
                want: Err(PlacementError::NoClusters),
                left_out: &[],
            },
            Case {
                what: "one name for two clusters",
                regs: &[("train", 1), ("train", 2)],
                placement: Placement::All,
                want: Err(PlacementError::NameTwice {
                    name: "train".into(),
                }),
                left_out: &[],
            },
        ];
        for c in cases {
            let got = select_clusters(&c.placement, c.regs);
            match (&got, &c.want) {
                (Ok(sel), Ok(want)) => {
                    assert_eq!(&sel.clusters, want, "{}", c.what);
                    if c.left_out.is_empty() {
                        assert!(sel.notes.is_empty(), "{}: {:?}", c.what, sel.notes);
                    } else {
                        assert_eq!(sel.notes.len(), 1, "{}: {:?}", c.what, sel.notes);
                        let note = &sel.notes[0];
                        let tail = note
                            .split_once("leaving out ")
                            .map(|(_, t)| t)
                            .unwrap_or_else(|| panic!("{}: note {note:?}", c.what));
                        let left: Vec<&str> = c.left_out.to_vec();
                        assert!(
                            tail.starts_with(&and_list(&left)),
                            "{}: note {note:?} does not name {left:?} as left out",
                            c.what
                        );
                        assert!(sel.notes[0].contains("excludes nothing"), "{}", c.what);
                    }
                }
                (Err(e), Err(want)) => assert_eq!(e, want, "{}", c.what),
                _ => panic!("{}: got {got:?}, want {:?}", c.what, c.want),
            }
        }
    }

    #[test]
    fn unknown_name_error_lists_the_known_names() {
        let e = select_clusters(&names(&["x"]), &[("train", 1), ("inference", 2)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the placement names cluster \"x\", which the job does not have (its clusters: \"train\", \"inference\")"
        );
    }

    #[test]
    fn alias_note_names_both_sides() {
        let sel = select_clusters(
            &names(&["train"]),
            &[("train", 1), ("inference", 1), ("teacher:t", 2)],
        )
        .unwrap();
        assert_eq!(
            sel.notes,
            vec![
                "\"train\" and \"inference\" name one cluster (e.g. a colocated run): the placement \
                 selects it through \"train\", so leaving out \"inference\" excludes nothing"
                    .to_string()
            ]
        );
        let sel = select_clusters(&names(&["b"]), &[("a", 1), ("b", 1), ("c", 1)]).unwrap();
        assert_eq!(
            sel.notes,
            vec![
                "\"a\", \"b\" and \"c\" name one cluster (e.g. a colocated run): the placement \
                 selects it through \"b\", so leaving out \"a\" and \"c\" excludes nothing"
                    .to_string()
            ]
        );
    }

    /// `plan_unit_nodes` cases: the selected clusters' nodes, the count,
    /// and the node of each unit (or the error).
    #[test]
    fn plan_unit_nodes_table() {
        struct Case {
            what: &'static str,
            clusters: &'static [&'static [&'static str]],
            count: Option<usize>,
            want: Result<&'static [&'static str], PlacementError>,
        }
        let cases = [
            Case {
                what: "no count: two per node, round-robin",
                clusters: &[&["n0", "n1", "n2"]],
                count: None,
                want: Ok(&["n0", "n1", "n2", "n0", "n1", "n2"]),
            },
            Case {
                what: "no count over two clusters",
                clusters: &[&["a0", "a1"], &["b0"]],
                count: None,
                want: Ok(&["a0", "a1", "b0", "a0", "a1", "b0"]),
            },
            Case {
                what: "count below the node count: the first nodes",
                clusters: &[&["a0", "a1"], &["b0", "b1"]],
                count: Some(3),
                want: Ok(&["a0", "a1", "b0"]),
            },
            Case {
                what: "count equal to the node count",
                clusters: &[&["a0", "a1"], &["b0"]],
                count: Some(3),
                want: Ok(&["a0", "a1", "b0"]),
            },
            Case {
                what: "count above the node count wraps around",
                clusters: &[&["a0", "a1"], &["b0"]],
                count: Some(7),
                want: Ok(&["a0", "a1", "b0", "a0", "a1", "b0", "a0"]),
            },
            Case {
                what: "one unit",
                clusters: &[&["a0", "a1"]],
                count: Some(1),
                want: Ok(&["a0"]),
            },
            Case {
                what: "one node, several units",
                clusters: &[&["only"]],
                count: Some(3),
                want: Ok(&["only", "only", "only"]),
            },
            Case {
                what: "a node shared by two clusters counts once",
                clusters: &[&["n0", "n1"], &["n1", "n2"]],
                count: None,
                want: Ok(&["n0", "n1", "n2", "n0", "n1", "n2"]),
            },
            Case {
                what: "a node listed twice in one cluster counts once",
                clusters: &[&["n1", "n0", "n1"]],
                count: None,
                want: Ok(&["n1", "n0", "n1", "n0"]),
            },
            Case {
                what: "given node order is kept (no sorting)",
                clusters: &[&["z", "a", "m"]],
                count: Some(4),
                want: Ok(&["z", "a", "m", "z"]),
            },
            Case {
                what: "the same cluster twice",
                clusters: &[&["n0", "n1"], &["n0", "n1"]],
                count: None,
                want: Ok(&["n0", "n1", "n0", "n1"]),
            },
            Case {
                what: "an empty cluster beside others",
                clusters: &[&[], &["b0"]],
                count: Some(2),
                want: Ok(&["b0", "b0"]),
            },
            Case {
                what: "count zero",
                clusters: &[&["n0"]],
                count: Some(0),
                want: Err(PlacementError::ZeroCount),
            },
            Case {
                what: "no clusters",
                clusters: &[],
                count: None,
                want: Err(PlacementError::NoNodes),
            },
            Case {
                what: "clusters without nodes",
                clusters: &[&[], &[]],
                count: Some(2),
                want: Err(PlacementError::NoNodes),
            },
        ];
        for c in cases {
            let got = plan_unit_nodes(c.clusters, c.count);
            match (&got, &c.want) {
                (Ok(nodes), Ok(want)) => assert_eq!(nodes, want, "{}", c.what),
                (Err(e), Err(want)) => assert_eq!(e, want, "{}", c.what),
                _ => panic!("{}: got {got:?}, want {:?}", c.what, c.want),
            }
        }
    }

    /// The two together, as a launcher uses them: a colocated run with a
    /// teacher, placing on the training cluster only.
    #[test]
    fn select_then_plan() {
        let train = vec!["n0", "n1"];
        let teacher = vec!["n1", "n2"];
        let all = [train.clone(), teacher.clone()];
        let regs = [("train", 0usize), ("inference", 0), ("teacher:t", 1)];
        let sel = select_clusters(&names(&["train"]), &regs).unwrap();
        let chosen: Vec<&Vec<&str>> = sel.clusters.iter().map(|&i| &all[i]).collect();
        assert_eq!(
            plan_unit_nodes(&chosen, None).unwrap(),
            vec!["n0", "n1", "n0", "n1"]
        );
        let sel = select_clusters(&Placement::All, &regs).unwrap();
        let chosen: Vec<&Vec<&str>> = sel.clusters.iter().map(|&i| &all[i]).collect();
        assert_eq!(
            plan_unit_nodes(&chosen, Some(5)).unwrap(),
            vec!["n0", "n1", "n2", "n0", "n1"]
        );
    }

    /// Same input, same plan: no hashing order leaks into the result.
    #[test]
    fn plans_are_deterministic() {
        let clusters: Vec<Vec<String>> = (0..8)
            .map(|c| {
                (0..5)
                    .map(|n| format!("node-{}", (c * 3 + n) % 17))
                    .collect()
            })
            .collect();
        let first = plan_unit_nodes(&clusters, Some(50)).unwrap();
        for _ in 0..20 {
            assert_eq!(plan_unit_nodes(&clusters, Some(50)).unwrap(), first);
        }
        // The first 17 units land on 17 distinct nodes.
        let distinct: HashSet<&String> = first[..17].iter().collect();
        assert_eq!(distinct.len(), 17);
    }
}
