//! Stop strings over streamed text: text that could still become a stop
//! string is held back, and generation ends where one appears.

/// What happened to a piece of text pushed into a [`StopMatcher`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// No stop string yet; `released` is safe to send.
    Continue { released: String },
    /// A stop string appeared: `released` is the text before it, `stop` the
    /// stop string. Nothing after it is sent.
    Stopped { released: String, stop: String },
}

/// Finds the earliest stop string in a stream of text.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    /// Empty strings in `stops` are ignored.
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.pending.push_str(text);
        // The earliest stop string, if any is complete.
        let earliest = self
            .stops
            .iter()
            .filter_map(|stop| self.pending.find(stop.as_str()).map(|pos| (pos, stop)))
            .min_by_key(|(pos, _)| *pos);
        if let Some((pos, stop)) = earliest {
            let stop = stop.clone();
            let released = self.pending[..pos].to_string();
            self.pending.clear();
            return StopOutcome::Stopped { released, stop };
        }
        // Hold back the longest tail that starts some stop string.
        let held = self
            .stops
            .iter()
            .map(|stop| longest_suffix_prefix(&self.pending, stop))
            .max()
            .unwrap_or(0);
        let released: String = self.pending[..self.pending.len() - held].to_string();
        self.pending.drain(..self.pending.len() - held);
        StopOutcome::Continue { released }
    }

    /// The held-back text, at the end of generation.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    stop.char_indices()
        .map(|(i, _)| i)
        .skip(1)
        .filter(|&len| text.ends_with(&stop[..len]))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue { released } => out.push_str(&released),
                StopOutcome::Stopped { released, stop } => {
                    out.push_str(&released);
                    return (out, Some(stop));
                }
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn stop_split_over_pieces() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".to_string(), Some("END".to_string()))
        );
    }

    #[test]
    fn false_start_is_released() {
        assert_eq!(run(&["END"], &["abc E", "x"]), ("abc Ex".to_string(), None));
        assert_eq!(run(&["END"], &["abc EN"]), ("abc EN".to_string(), None));
    }

    #[test]
    fn earliest_stop_wins_and_multibyte_is_safe() {
        assert_eq!(
            run(&["été", "b"], &["aé", "tébc"]),
            ("a".to_string(), Some("été".to_string()))
        );
    }
}
