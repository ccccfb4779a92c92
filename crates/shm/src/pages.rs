//! The slab's page modes: what a unit asks for ([`HugePages`]), what it
//! got ([`PageMode`]) and what the host offers.

use std::os::fd::OwnedFd;

/// The page mode a unit asks for its slab (`--huge-pages`,
/// `units.huge_pages`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// The best the host offers: hugetlb when its free huge pages hold
    /// the whole slab, else transparent huge pages when shmem_enabled
    /// grants them on request, else 4 KiB pages. Never fails a start.
    #[default]
    Auto,
    /// A hugetlb memfd (`MFD_HUGETLB`): needs free huge pages
    /// (`/proc/sys/vm/nr_hugepages`); the slab rounds up to whole huge
    /// pages.
    Hugetlb,
    /// A plain memfd with `MADV_HUGEPAGE` on every mapping: needs
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` to be
    /// `advise`, `within_size`, `always` or `force`.
    Thp,
    /// 4 KiB pages.
    Off,
}

impl std::str::FromStr for HugePages {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "hugetlb" => Ok(Self::Hugetlb),
            "thp" => Ok(Self::Thp),
            "4k" | "off" => Ok(Self::Off),
            other => Err(format!(
                "huge pages mode {other:?}: expected auto, hugetlb, thp or 4k"
            )),
        }
    }
}

impl std::fmt::Display for HugePages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Hugetlb => "hugetlb",
            Self::Thp => "thp",
            Self::Off => "4k",
        })
    }
}

/// The page mode a slab is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageMode {
    /// 4 KiB pages.
    Small,
    /// Transparent huge pages advised on the mapping.
    Thp,
    /// A hugetlb memfd.
    Hugetlb,
}

impl PageMode {
    /// Every mode, in the order metrics list them.
    pub const ALL: [PageMode; 3] = [PageMode::Small, PageMode::Thp, PageMode::Hugetlb];

    /// Its name in stats, metrics and `stowage status`: `4k`, `thp`,
    /// `hugetlb`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Small => "4k",
            Self::Thp => "thp",
            Self::Hugetlb => "hugetlb",
        }
    }
}

impl std::fmt::Display for PageMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// What the host offers: its default huge page size and free huge pages
/// (`/proc/meminfo`), and the shmem THP setting.
pub(crate) struct HostPages {
    pub(crate) huge_size: u64,
    /// Free huge pages not reserved by another mapping.
    pub(crate) huge_free: u64,
    /// The selected word of shmem_enabled (`never` when unreadable).
    pub(crate) shmem_enabled: String,
}

impl HostPages {
    pub(crate) fn read() -> Self {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| {
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let shmem = std::fs::read_to_string(SHMEM_ENABLED).unwrap_or_default();
        HostPages {
            huge_size: field("Hugepagesize:") << 10,
            huge_free: field("HugePages_Free:").saturating_sub(field("HugePages_Rsvd:")),
            shmem_enabled: shmem
                .split_whitespace()
                .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
                .unwrap_or("never")
                .to_string(),
        }
    }

    /// Whether the free huge pages hold a slab of `len` bytes; if not, why.
    pub(crate) fn hugetlb_fits(&self, len: u64) -> Result<(), String> {
        if self.huge_size == 0 {
            return Err("the host has no hugetlb pages (no Hugepagesize in /proc/meminfo)".into());
        }
        let need = len.div_ceil(self.huge_size);
        if self.huge_free < need {
            return Err(format!(
                "{} free hugetlb pages of {} KiB, the slab needs {need}: raise /proc/sys/vm/nr_hugepages",
                self.huge_free,
                self.huge_size >> 10
            ));
        }
        Ok(())
    }

    /// Whether a mapping that asks gets transparent huge pages for shared
    /// memory.
    pub(crate) fn thp_on_request(&self) -> bool {
        matches!(
            self.shmem_enabled.as_str(),
            "advise" | "within_size" | "always" | "force"
        )
    }

    pub(crate) fn thp_usable(&self) -> Result<(), String> {
        if self.thp_on_request() {
            Ok(())
        } else {
            Err(format!(
                "{SHMEM_ENABLED} is {}: set it to advise (or within_size)",
                self.shmem_enabled
            ))
        }
    }
}

/// ", rounded up from LEN" when hugetlb made the slab larger.
pub(crate) fn rounded(asked: u64, got: u64) -> String {
    if got > asked {
        format!("; the slab rounds up from {asked} to {got} bytes")
    } else {
        String::new()
    }
}

/// Whether `fd` is a file on hugetlbfs (a hugetlb memfd).
pub(crate) fn is_hugetlb(fd: &OwnedFd) -> bool {
    const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;
    rustix::fs::fstatfs(fd).is_ok_and(|st| st.f_type as u64 == HUGETLBFS_MAGIC)
}
