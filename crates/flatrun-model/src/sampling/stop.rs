//! Stop strings matched across token boundaries: text that could still turn
//! into a stop string is held back until it either does (generation stops,
//! the stop string is not emitted) or cannot any more (it is released).

/// What to do with one chunk of generated text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopResult {
    /// Text that is safe to show now.
    pub emit: String,
    /// A stop string was completed; nothing after it is emitted.
    pub stopped: bool,
}

/// Watches generated text for any of a set of stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> StopMatcher {
        StopMatcher {
            stops: stops
                .into_iter()
                .map(Into::into)
                .filter(|s: &String| !s.is_empty())
                .collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Feed the next piece of text.
    pub fn push(&mut self, text: &str) -> StopResult {
        if self.stopped {
            return StopResult {
                emit: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(text);
        // A complete stop string: emit what precedes the earliest one and stop.
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let emit = self.held[..at].to_string();
            self.held.clear();
            self.stopped = true;
            return StopResult {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest tail that is the start of some stop string.
        let keep = self.longest_partial_tail();
        let split = self.held.len() - keep;
        let emit = self.held[..split].to_string();
        self.held.drain(..split);
        StopResult {
            emit,
            stopped: false,
        }
    }

    /// Release whatever is held back (generation ended without a stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    fn longest_partial_tail(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            // Tails of `held` that are proper prefixes of `stop`, longest first.
            let max = (stop.len() - 1).min(self.held.len());
            for len in (best + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start)
                    && stop.as_bytes().starts_with(&self.held.as_bytes()[start..])
                {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}
