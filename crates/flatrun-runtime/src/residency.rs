//! Which weights stay resident: the plan a [`crate::Residency`] policy makes
//! over the manifest.

use crate::options::Residency;
use flatrun_model::Manifest;

/// Per-layer (and output-head) decision: keep resident or stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidencyPlan {
    /// `resident[i]`: layer `i` keeps its pages between tokens.
    pub resident: Vec<bool>,
    /// The output head keeps its pages between tokens.
    pub output_resident: bool,
    /// Bytes kept resident by this plan.
    pub resident_bytes: u64,
    /// Bytes streamed (re-read or re-faulted) per token.
    pub streamed_bytes_per_token: u64,
}

impl ResidencyPlan {
    /// Plan `policy` over `manifest`.
    ///
    /// For `Cap(bytes)`, every layer and the output head are read once per
    /// token, so the bytes streamed per token are the total minus what is
    /// kept: keeping the largest items first (greedy by size) minimizes
    /// streamed bytes for items of (nearly) equal size, which decoder layers are.
    pub fn new(policy: Residency, manifest: &Manifest) -> ResidencyPlan {
        let n = manifest.layers.len();
        let total: u64 =
            manifest.layers.iter().map(|l| l.bytes).sum::<u64>() + manifest.output.bytes;
        let (resident, output_resident) = match policy {
            Residency::Resident => (vec![true; n], true),
            Residency::Stream => (vec![false; n], false),
            Residency::Cap(cap) => {
                // Candidates: (bytes, Some(layer)) or (bytes, None) for the head.
                let mut items: Vec<(u64, Option<usize>)> = manifest
                    .layers
                    .iter()
                    .map(|l| (l.bytes, Some(l.index)))
                    .chain(std::iter::once((manifest.output.bytes, None)))
                    .collect();
                items.sort_by(|a, b| b.0.cmp(&a.0));
                let mut left = cap;
                let mut resident = vec![false; n];
                let mut head = false;
                for (bytes, which) in items {
                    if bytes <= left {
                        left -= bytes;
                        match which {
                            Some(i) => resident[i] = true,
                            None => head = true,
                        }
                    }
                }
                (resident, head)
            }
        };
        let kept: u64 = manifest
            .layers
            .iter()
            .filter(|l| resident[l.index])
            .map(|l| l.bytes)
            .sum::<u64>()
            + if output_resident {
                manifest.output.bytes
            } else {
                0
            };
        ResidencyPlan {
            resident,
            output_resident,
            resident_bytes: kept,
            streamed_bytes_per_token: total - kept,
        }
    }

    /// Plan `policy` like [`ResidencyPlan::new`], where a `Cap` also pays
    /// for the buffers that streamed items are read into: `depth + 1`
    /// buffers of the largest layer or head chunk (`chunk_bytes`), so that
    /// kept weights plus read buffers stay within the cap.
    pub fn with_stream_buffers(
        policy: Residency,
        manifest: &Manifest,
        depth: usize,
        chunk_bytes: u64,
    ) -> ResidencyPlan {
        let policy = match policy {
            Residency::Cap(cap) => {
                let largest = manifest.largest_layer_bytes().max(chunk_bytes);
                let reserve = largest.saturating_mul(depth.max(1) as u64 + 1);
                Residency::Cap(cap.saturating_sub(reserve))
            }
            other => other,
        };
        ResidencyPlan::new(policy, manifest)
    }

    /// Whether layer `i` is kept resident.
    pub fn is_resident(&self, i: usize) -> bool {
        self.resident.get(i).copied().unwrap_or(false)
    }
}
