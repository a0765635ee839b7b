//! Stop strings over streamed text: text that might begin a stop string is held back until
//! it cannot, and generation ends before the first stop string that completes.

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text that is safe to show: it cannot be part of a stop string.
    pub emit: String,
    /// A stop string completed; `emit` ends right before it and nothing follows.
    pub stopped: bool,
}

/// Finds stop strings in text that arrives in pieces.
///
/// The result does not depend on how the text is split: the stop string that completes
/// first in the character stream wins (of two completing at the same point, the one that
/// starts earlier), so "xabcd" with stops "abcd" and "bc" stops after "xa" whether it
/// arrives whole or a character at a time.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty strings are ignored; they would stop before any text.
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    pub fn push(&mut self, new_text: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                emit: String::new(),
                stopped: true,
            };
        }
        if self.stops.is_empty() {
            return StopStep {
                emit: new_text.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(new_text);

        // Held text never contains a whole stop string, so any match involves the new text.
        let first_match = self
            .stops
            .iter()
            .filter_map(|stop| {
                self.held
                    .find(stop.as_str())
                    .map(|at| (at + stop.len(), at))
            })
            .min();
        if let Some((_, start)) = first_match {
            self.held.truncate(start);
            self.stopped = true;
            return StopStep {
                emit: std::mem::take(&mut self.held),
                stopped: true,
            };
        }

        let keep_from = self.earliest_partial_match();
        let emit = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        StopStep {
            emit,
            stopped: false,
        }
    }

    /// Releases held text at the end of generation; nothing after a stop.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Start of the longest suffix of the held text that some stop string begins with
    /// (the held text's length if none).
    fn earliest_partial_match(&self) -> usize {
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let window_start = self
            .held
            .len()
            .saturating_sub(longest_stop.saturating_sub(1));
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .filter(|i| *i >= window_start)
            .find(|i| {
                let tail = &self.held[*i..];
                self.stops.iter().any(|stop| stop.starts_with(tail))
            })
            .unwrap_or(self.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    /// Feeds pieces and returns (each push's emit, stopped after which push, finish text).
    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, Option<usize>, String) {
        let mut m = matcher(stops);
        let mut emits = Vec::new();
        let mut stopped_at = None;
        for (i, piece) in pieces.iter().enumerate() {
            let step = m.push(piece);
            emits.push(step.emit);
            if step.stopped && stopped_at.is_none() {
                stopped_at = Some(i);
            }
        }
        (emits, stopped_at, m.finish())
    }

    #[test]
    fn empty_stop_list_passes_through() {
        let (emits, stopped, rest) = run(&[], &["a", "</s", ">b"]);
        assert_eq!(emits, ["a", "</s", ">b"]);
        assert_eq!(stopped, None);
        assert_eq!(rest, "");
        let (emits, _, _) = run(&[""], &["xy"]);
        assert_eq!(emits, ["xy"]);
    }

    #[test]
    fn match_spanning_pushes() {
        let (emits, stopped, rest) = run(&["</s>"], &["Hello <", "/", "s", "> tail"]);
        assert_eq!(emits, ["Hello ", "", "", ""]);
        assert_eq!(stopped, Some(3));
        assert_eq!(rest, "");
    }

    #[test]
    fn held_text_is_released_when_it_cannot_match() {
        let (emits, stopped, rest) = run(&["</s>"], &["a <", "/x", "y"]);
        assert_eq!(emits, ["a ", "</x", "y"]);
        assert_eq!(stopped, None);
        assert_eq!(rest, "");
    }

    #[test]
    fn no_false_holds_at_the_end() {
        // Only a real prefix of a stop string is held; "<" is, "x" and "s>" are not.
        let (emits, _, rest) = run(&["</s>"], &["x", "s>", "<"]);
        assert_eq!(emits, ["x", "s>", ""]);
        assert_eq!(rest, "<");
        let (emits, _, rest) = run(&["User:"], &["The User", " said"]);
        assert_eq!(emits, ["The ", "User said"]);
        assert_eq!(rest, "");
    }

    #[test]
    fn stop_at_the_very_start() {
        let (emits, stopped, rest) = run(&["###"], &["###", "more"]);
        assert_eq!(emits, ["", ""]);
        assert_eq!(stopped, Some(0));
        assert_eq!(rest, "");
    }

    #[test]
    fn hold_starts_at_the_latest_possible_start() {
        // "aab": the first "a" cannot start "abc" any more, the second can.
        let (emits, stopped, _) = run(&["abc"], &["aab", "c!"]);
        assert_eq!(emits, ["a", ""]);
        assert_eq!(stopped, Some(1));
    }

    #[test]
    fn overlapping_candidates() {
        // While "abc" is held both stops are possible; "bcd" completes first.
        let (emits, stopped, _) = run(&["abcx", "bcd"], &["a", "b", "c", "d"]);
        assert_eq!(emits, ["", "", "", "a"]);
        assert_eq!(stopped, Some(3));
        // A self-overlapping stop string: "aab" inside "aaab".
        let (emits, stopped, _) = run(&["aab"], &["a", "a", "a", "b"]);
        assert_eq!(emits, ["", "", "a", ""]);
        assert_eq!(stopped, Some(3));
    }

    #[test]
    fn first_completed_stop_wins_regardless_of_chunking() {
        let stops = ["abcd", "bc"];
        let (whole, _, _) = run(&stops, &["xabcd"]);
        let (chars, _, _) = run(&stops, &["x", "a", "b", "c", "d"]);
        assert_eq!(whole.concat(), "xa");
        assert_eq!(chars.concat(), "xa");
        // Same end: the longer, earlier-starting one wins.
        let (emits, _, _) = run(&["xbc", "bc"], &["axbcz"]);
        assert_eq!(emits, ["a"]);
    }

    #[test]
    fn multibyte_text_splits_on_char_boundaries() {
        let (emits, stopped, rest) = run(&["é!"], &["café", " ok", "é", "!"]);
        assert_eq!(emits, ["caf", "é ok", "", ""]);
        assert_eq!(stopped, Some(3));
        assert_eq!(rest, "");
        let (emits, _, rest) = run(&["😀😀"], &["a😀", "b😀"]);
        assert_eq!(emits, ["a", "😀b"]);
        assert_eq!(rest, "😀");
    }

    #[test]
    fn nothing_after_a_stop() {
        let mut m = matcher(&["END"]);
        assert_eq!(
            m.push("doneEND trailing"),
            StopStep {
                emit: "done".into(),
                stopped: true
            }
        );
        assert!(m.is_stopped());
        assert_eq!(
            m.push("more"),
            StopStep {
                emit: String::new(),
                stopped: true
            }
        );
        assert_eq!(m.finish(), "");
    }
}
