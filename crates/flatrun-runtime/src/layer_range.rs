//! Running a subset of the decoder layers (research use: "what does the
//! model predict from the first N layers?").
//!
//! A skipped layer is an identity on the residual stream: its weights are
//! never opened, read ahead or faulted in, and its KV cache is left empty.
//!
//! ```
//! use flatrun_runtime::LayerSelection;
//!
//! let sel: LayerSelection = "0-3,8-11".parse().unwrap();
//! assert!(sel.runs(2) && !sel.runs(5) && sel.runs(11));
//! assert!(sel.check(30).is_ok());
//! assert!("0-40".parse::<LayerSelection>().unwrap().check(30).is_err());
//! ```

use crate::error::{Result, RuntimeError};
use std::ops::RangeInclusive;
use std::str::FromStr;

/// A set of decoder layers, written like `0-11`, `5` or `0-3,8-11`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSelection {
    ranges: Vec<RangeInclusive<usize>>,
}

impl LayerSelection {
    /// Every layer of a model with `n_layer` layers.
    pub fn all(n_layer: usize) -> LayerSelection {
        LayerSelection {
            ranges: if n_layer == 0 {
                Vec::new()
            } else {
                vec![0..=n_layer - 1]
            },
        }
    }

    /// Whether layer `il` runs.
    pub fn runs(&self, il: usize) -> bool {
        self.ranges.iter().any(|r| r.contains(&il))
    }

    /// The largest layer index named.
    pub fn last(&self) -> Option<usize> {
        self.ranges.iter().map(|r| *r.end()).max()
    }

    /// Check that every layer named exists in a model of `n_layer` layers.
    pub fn check(&self, n_layer: usize) -> Result<()> {
        match self.last() {
            Some(last) if last >= n_layer => Err(RuntimeError::Option {
                option: "layers",
                what: format!(
                    "{self} names layer {last}, but the model has {n_layer} layers (0-{})",
                    n_layer.saturating_sub(1)
                ),
            }),
            _ => Ok(()),
        }
    }

    /// How many of the model's `n_layer` layers run.
    pub fn count(&self, n_layer: usize) -> usize {
        (0..n_layer).filter(|&il| self.runs(il)).count()
    }
}

impl std::fmt::Display for LayerSelection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, r) in self.ranges.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if r.start() == r.end() {
                write!(f, "{}", r.start())?;
            } else {
                write!(f, "{}-{}", r.start(), r.end())?;
            }
        }
        Ok(())
    }
}

impl FromStr for LayerSelection {
    type Err = RuntimeError;

    /// Comma-separated `A-B` (inclusive, `A <= B`) or `N` items.
    fn from_str(text: &str) -> Result<LayerSelection> {
        let bad = |why: &str| RuntimeError::Option {
            option: "layers",
            what: format!("`{text}` {why} (expected a range like 0-11, 5, or 0-3,8-11)"),
        };
        let number = |s: &str| s.trim().parse::<usize>().map_err(|_| bad("is not a range"));
        let mut ranges = Vec::new();
        for item in text.split(',') {
            let range = match item.split_once('-') {
                Some((a, b)) => number(a)?..=number(b)?,
                None => {
                    let n = number(item)?;
                    n..=n
                }
            };
            if range.start() > range.end() {
                return Err(bad("has a range that ends before it starts"));
            }
            ranges.push(range);
        }
        Ok(LayerSelection { ranges })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranges_and_lists() {
        let s: LayerSelection = "0-3, 8-11".parse().unwrap();
        assert_eq!(s.to_string(), "0-3,8-11");
        assert_eq!(s.count(30), 8);
        assert_eq!("5".parse::<LayerSelection>().unwrap().count(30), 1);
        assert!("5-2".parse::<LayerSelection>().is_err());
        assert!("x".parse::<LayerSelection>().is_err());
        assert!("".parse::<LayerSelection>().is_err());
        assert!("1-".parse::<LayerSelection>().is_err());
    }

    #[test]
    fn checks_against_the_model() {
        assert!("0-29".parse::<LayerSelection>().unwrap().check(30).is_ok());
        assert!("0-30".parse::<LayerSelection>().unwrap().check(30).is_err());
        assert_eq!(LayerSelection::all(30).count(30), 30);
    }
}
