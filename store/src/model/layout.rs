//! The parallel layout of a job ([`Layout`]: dp, tp, pp, ZeRO stage) and a rank's place in it
//! ([`Coords`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The parallel layout of a job: data, tensor and pipeline parallel degrees and the ZeRO
/// stage. Ranks are ordered tensor-parallel fastest, then data-parallel, then pipeline
/// (`rank = (pp_idx * dp + dp_idx) * tp + tp_idx`), as Megatron orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel degree.
    pub dp: u32,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Pipeline-parallel degree.
    pub pp: u32,
    /// ZeRO stage (0 = none, 1-3).
    #[serde(default)]
    pub zero: u8,
}

/// A rank's place in a [`Layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    /// Data-parallel index.
    pub dp: u32,
    /// Tensor-parallel index.
    pub tp: u32,
    /// Pipeline stage.
    pub pp: u32,
}

impl Layout {
    /// A single process holding everything.
    pub const SINGLE: Layout = Layout {
        dp: 1,
        tp: 1,
        pp: 1,
        zero: 0,
    };

    /// A layout, checked.
    pub fn new(dp: u32, tp: u32, pp: u32, zero: u8) -> Result<Self> {
        let l = Layout { dp, tp, pp, zero };
        l.validate()?;
        Ok(l)
    }

    /// Check degrees and stage.
    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.tp == 0 || self.pp == 0 {
            return Err(Error::invalid(format!(
                "layout {self}: every degree must be at least 1"
            )));
        }
        if self.zero > 3 {
            return Err(Error::invalid(format!(
                "layout {self}: ZeRO stage must be 0, 1, 2 or 3"
            )));
        }
        if (self.dp as u64) * (self.tp as u64) * (self.pp as u64) > 1 << 24 {
            return Err(Error::invalid(format!(
                "layout {self}: more than 16M ranks"
            )));
        }
        Ok(())
    }

    /// Number of ranks.
    pub fn world(&self) -> u32 {
        self.dp * self.tp * self.pp
    }

    /// The coordinates of `rank`.
    pub fn coords(&self, rank: u32) -> Coords {
        Coords {
            tp: rank % self.tp,
            dp: (rank / self.tp) % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    /// The rank at `coords`.
    pub fn rank(&self, c: Coords) -> u32 {
        (c.pp * self.dp + c.dp) * self.tp + c.tp
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={},tp={},pp={}", self.dp, self.tp, self.pp)?;
        if self.zero > 0 {
            write!(f, ",zero={}", self.zero)?;
        }
        Ok(())
    }
}

impl FromStr for Layout {
    type Err = Error;
    /// `dp=2,tp=2,pp=1[,zero=1]`; missing degrees default to 1.
    fn from_str(s: &str) -> Result<Self> {
        let mut l = Layout::SINGLE;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                Error::invalid(format!(
                    "layout {s:?}: expected key=value pairs like dp=2,tp=2,pp=1"
                ))
            })?;
            let v: u32 = v.trim().parse().map_err(|_| {
                Error::invalid(format!("layout {s:?}: {k} must be a positive integer"))
            })?;
            match k.trim() {
                "dp" => l.dp = v,
                "tp" => l.tp = v,
                "pp" => l.pp = v,
                "zero" => {
                    l.zero = u8::try_from(v)
                        .map_err(|_| Error::invalid(format!("layout {s:?}: bad zero stage")))?
                }
                other => {
                    return Err(Error::invalid(format!(
                        "layout {s:?}: unknown dimension {other:?} (known: dp, tp, pp, zero)"
                    )));
                }
            }
        }
        l.validate()?;
        Ok(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_parse_and_coords() {
        let l: Layout = "dp=2,tp=2,pp=3,zero=1".parse().unwrap();
        assert_eq!(l.world(), 12);
        for r in 0..12 {
            assert_eq!(l.rank(l.coords(r)), r);
        }
        assert_eq!(
            l.coords(5),
            Coords {
                dp: 0,
                tp: 1,
                pp: 1
            }
        );
        assert_eq!(l.to_string(), "dp=2,tp=2,pp=3,zero=1");
        assert!("dp=0".parse::<Layout>().is_err());
        assert!(
            "xp=2"
                .parse::<Layout>()
                .unwrap_err()
                .to_string()
                .contains("unknown dimension")
        );
        assert!("zero=5".parse::<Layout>().is_err());
    }
}
