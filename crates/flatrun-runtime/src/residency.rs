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
    /// When the head is not kept whole: bytes at its start (whole rows,
    /// rounded down by the executor) kept anyway, so that what a cap leaves
    /// after the whole items it keeps is not wasted; the rest of the head is
    /// streamed. 0 when the head is kept whole or not at all.
    pub output_kept_bytes: u64,
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
    /// streamed bytes for items of (nearly) equal size, which decoder layers
    /// are. What is left of the cap after that goes to the first rows of a
    /// head that did not fit whole ([`ResidencyPlan::output_kept_bytes`]).
    pub fn new(policy: Residency, manifest: &Manifest) -> ResidencyPlan {
        let n = manifest.layers.len();
        let total: u64 =
            manifest.layers.iter().map(|l| l.bytes).sum::<u64>() + manifest.output.bytes;
        let (resident, output_resident, output_kept_bytes) = match policy {
            Residency::Resident => (vec![true; n], true, 0),
            Residency::Stream => (vec![false; n], false, 0),
            Residency::Custom(choose) => {
                let mut resident = choose(manifest);
                resident.resize(n, false);
                (resident, false, 0)
            }
            Residency::Cap(cap) => {
                // Candidates: (bytes, Some(layer)) or (bytes, None) for the head.
                let mut items: Vec<(u64, Option<usize>)> = manifest
                    .layers
                    .iter()
                    .map(|l| (l.bytes, Some(l.index)))
                    .chain(std::iter::once((manifest.output.bytes, None)))
                    .collect();
                items.sort_by_key(|&(bytes, _)| std::cmp::Reverse(bytes));
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
                // The rest of the cap: the head's first rows.
                let partial = if head { 0 } else { left };
                (resident, head, partial)
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
                output_kept_bytes
            };
        ResidencyPlan {
            resident,
            output_resident,
            output_kept_bytes,
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

    /// The same plan with nothing of a partly kept head kept (for paths
    /// that stream the head whole).
    pub fn without_partial_head(mut self) -> ResidencyPlan {
        self.resident_bytes -= self.output_kept_bytes;
        self.streamed_bytes_per_token += self.output_kept_bytes;
        self.output_kept_bytes = 0;
        self
    }

    /// The plan with the partly kept head rounded down to whole rows of
    /// `row_bytes`; returns the plan and the number of kept rows.
    pub fn with_head_rows(mut self, row_bytes: u64) -> (ResidencyPlan, usize) {
        let rows = self.output_kept_bytes / row_bytes.max(1);
        let kept = rows * row_bytes;
        self.resident_bytes -= self.output_kept_bytes - kept;
        self.streamed_bytes_per_token += self.output_kept_bytes - kept;
        self.output_kept_bytes = kept;
        (self, rows as usize)
    }

    /// Whether layer `i` is kept resident.
    pub fn is_resident(&self, i: usize) -> bool {
        self.resident.get(i).copied().unwrap_or(false)
    }
}
