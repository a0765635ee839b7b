//! Following an output that copies its input with edits (a rename, a changed argument,
//! a fixed line), for the n-gram drafter.
//!
//! Prompt lookup continues the latest earlier match of the last few tokens. An output
//! that edits the prompt breaks that match at every edit, and right after an edit the
//! latest match of a short suffix is usually somewhere else (the same `=` three lines
//! down, or the edited text written earlier). So the drafter also follows the copy
//! itself: an [`Alignment`] holds the position in the history that the output is
//! copying. Where the output leaves the source, the copy is found again at the earliest
//! place just past that point where the output's newest tokens continue the source, and
//! what the output wrote in place of the skipped source is remembered as an [`Edit`].
//! [`copy`] applies the remembered edits to what it drafts, so a rename is drafted right
//! from its second occurrence on.

/// How far past the point where the output left the source a resync looks.
const RESYNC_WINDOW: usize = 16;
/// Longest run of the output's newest tokens a resync matches.
const RESYNC_N: usize = 4;
/// Tokens written off the source after which the copy is taken to have ended.
const GIVE_UP_AFTER: usize = 32;
/// Longest span, on either side, remembered as an edit.
const MAX_EDIT_TOKENS: usize = 8;
/// Edits remembered at once; the least seen (then the oldest) is forgotten first.
const MAX_EDITS: usize = 64;

/// Source tokens the output wrote differently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    pub from: Vec<u32>,
    pub to: Vec<u32>,
}

#[derive(Debug)]
struct Remembered {
    edit: Edit,
    seen: u32,
    last_seen: u64,
}

/// The edits an output has made to its source so far.
#[derive(Debug, Default)]
pub struct EditMemory {
    edits: Vec<Remembered>,
    clock: u64,
}

impl EditMemory {
    /// The edit to apply where `history[at..]` begins, if any: the longest matching
    /// source, then the replacement seen most often (a source edited two ways, such as a
    /// name renamed in code but reworded in prose, is drafted the usual way), then the
    /// newest.
    pub fn at(&self, history: &[u32], at: usize) -> Option<&Edit> {
        let rest = history.get(at..)?;
        self.edits
            .iter()
            .filter(|r| rest.starts_with(&r.edit.from))
            .max_by_key(|r| (r.edit.from.len(), r.seen, r.last_seen))
            .map(|r| &r.edit)
    }

    /// Counts `edit` as seen once more (learning it when new).
    pub fn learn(&mut self, edit: Edit) {
        self.clock += 1;
        if let Some(known) = self.edits.iter_mut().find(|r| r.edit == edit) {
            known.seen += 1;
            known.last_seen = self.clock;
            return;
        }
        if self.edits.len() >= MAX_EDITS {
            if let Some(least) =
                (0..self.edits.len()).min_by_key(|&i| (self.edits[i].seen, self.edits[i].last_seen))
            {
                self.edits.swap_remove(least);
            }
        }
        self.edits.push(Remembered {
            edit,
            seen: 1,
            last_seen: self.clock,
        });
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.edits.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.edits.is_empty()
    }
}

/// Where the output stopped copying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Departure {
    /// The history index of the source token the output did not copy.
    source: usize,
    /// The history index of the first token the output wrote instead.
    output: usize,
}

/// What part of the history the output is copying, if any.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Alignment {
    /// The history index of the token the output copies next.
    anchor: Option<usize>,
    /// Set while the output writes something other than the source.
    departed: Option<Departure>,
}

impl Alignment {
    /// An output about to copy `history[source..]`.
    pub fn copying_from(source: usize) -> Self {
        Self {
            anchor: Some(source),
            departed: None,
        }
    }

    /// Whether a copy is followed at all, in step or left (the tests' view; drafting asks
    /// [`Self::is_in_step`]).
    #[cfg(test)]
    pub fn is_copying(&self) -> bool {
        self.anchor.is_some()
    }

    /// Whether the output is writing its source as it stands: a copy, not left or
    /// rejoined since.
    pub fn is_in_step(&self) -> bool {
        self.anchor.is_some() && self.departed.is_none()
    }

    /// Follows `token`, written after `history`. Returns the edit `token` completed:
    /// one learned where the output came back to the source, or a remembered one the
    /// output made again.
    pub fn advance(&mut self, history: &[u32], token: u32, edits: &EditMemory) -> Option<Edit> {
        let anchor = self.anchor?;
        let departed = match self.departed {
            Some(departed) => departed,
            None => {
                if edits.at(history, anchor).is_none() && history.get(anchor) == Some(&token) {
                    self.anchor = Some(anchor + 1);
                    return None;
                }
                // Either the output leaves the source here or a remembered edit starts:
                // both end where the output comes back.
                let departed = Departure {
                    source: anchor,
                    output: history.len(),
                };
                self.departed = Some(departed);
                departed
            }
        };
        let mut extended = history[departed.output..].to_vec();
        extended.push(token);
        let written = extended.as_slice();
        if let Some(edit) = edits.at(history, departed.source) {
            if written == edit.to.as_slice() {
                *self = Self::copying_from(departed.source + edit.from.len());
                return Some(edit.clone());
            }
            if edit.to.starts_with(written) {
                return None; // inside the edit: wait for its end
            }
        }
        if let Some((start, size)) = resync(history, departed, written) {
            *self = Self::copying_from(start + size);
            let from = &history[departed.source..start];
            let to = &written[..written.len() - size];
            let fits = |span: &[u32]| (1..=MAX_EDIT_TOKENS).contains(&span.len());
            return (fits(from) && fits(to) && from != to).then(|| Edit {
                from: from.to_vec(),
                to: to.to_vec(),
            });
        }
        if written.len() > GIVE_UP_AFTER {
            *self = Self::default();
        }
        None
    }
}

/// The earliest start in the window past `departed.source` where the newest tokens
/// `written` since the departure (the longest run first, at most [`RESYNC_N`]) appear in
/// the source: returns the start and the run's length, the copy resuming after it.
///
/// A run of one token is trusted only where the source it skips is at most one token
/// longer than what the output wrote in its place (a replacement, an insertion, or one
/// token dropped): a lone newline or indent recurs on every line, and matching it further
/// on would move the copy past the line the output is still writing, from where no later
/// resync (which looks forward only) could bring it back.
fn resync(history: &[u32], departed: Departure, written: &[u32]) -> Option<(usize, usize)> {
    let end = (departed.source + RESYNC_WINDOW).min(departed.output);
    for size in (1..=written.len().min(RESYNC_N)).rev() {
        let newest = &written[written.len() - size..];
        let replaced = written.len() - size;
        let end = match size {
            1 => end.min(departed.source + replaced + 2),
            _ => end,
        };
        let found = (departed.source..end)
            .take_while(|&start| start + size <= departed.output)
            .find(|&start| &history[start..start + size] == newest);
        if let Some(start) = found {
            return Some((start, size));
        }
    }
    None
}

/// Up to `max_k` tokens copied from `history[from..]` after `prefix`, with the
/// remembered edits applied.
pub fn copy(
    history: &[u32],
    from: usize,
    prefix: &[u32],
    edits: &EditMemory,
    max_k: usize,
) -> Vec<u32> {
    let mut out: Vec<u32> = prefix.iter().copied().take(max_k).collect();
    let mut at = from;
    while out.len() < max_k && at < history.len() {
        match edits.at(history, at) {
            Some(edit) => {
                out.extend_from_slice(&edit.to);
                at += edit.from.len();
            }
            None => {
                out.push(history[at]);
                at += 1;
            }
        }
    }
    out.truncate(max_k);
    out
}

/// What the aligned copy drafts after `history` (its newest token included), if it
/// has anything: the rest of a remembered edit the output is in the middle of, the
/// source where the output came back to it, or the source the copy is on.
pub fn continue_copy(
    history: &[u32],
    alignment: &Alignment,
    edits: &EditMemory,
    max_k: usize,
) -> Option<Vec<u32>> {
    let anchor = alignment.anchor?;
    let drafts = match alignment.departed {
        None => copy(history, anchor, &[], edits, max_k),
        Some(departed) => {
            let written = &history[departed.output..];
            let inside = edits
                .at(history, departed.source)
                .filter(|e| e.to.len() > written.len() && e.to.starts_with(written));
            match inside {
                Some(edit) => copy(
                    history,
                    departed.source + edit.from.len(),
                    &edit.to[written.len()..],
                    edits,
                    max_k,
                ),
                None => {
                    let (start, size) = resync(history, departed, written)?;
                    copy(history, start + size, &[], edits, max_k)
                }
            }
        }
    };
    (!drafts.is_empty()).then_some(drafts)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Follows `tokens` written after `history`, learning as the drafter does.
    fn follow(history: &mut Vec<u32>, a: &mut Alignment, edits: &mut EditMemory, tokens: &[u32]) {
        for &t in tokens {
            if let Some(edit) = a.advance(history, t, edits) {
                edits.learn(edit);
            }
            history.push(t);
        }
    }

    #[test]
    fn an_output_that_copies_is_followed() {
        let mut h = vec![1, 2, 3, 4, 5, 6, 7, 8, 100];
        let mut a = Alignment::copying_from(0);
        let mut edits = EditMemory::default();
        follow(&mut h, &mut a, &mut edits, &[1, 2, 3]);
        assert_eq!(continue_copy(&h, &a, &edits, 3), Some(vec![4, 5, 6]));
        assert!(edits.is_empty());
    }

    #[test]
    fn after_a_replacement_the_copy_resumes_where_the_output_rejoins_the_source() {
        // Source: 1 2 3 4 5 6 7 8 9; the output writes 1 2 50 51 4 ...: "3" became "50 51".
        let mut h = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 100];
        let mut a = Alignment::copying_from(0);
        let mut edits = EditMemory::default();
        follow(&mut h, &mut a, &mut edits, &[1, 2, 50, 51]);
        assert_eq!(
            continue_copy(&h, &a, &edits, 2),
            None,
            "nothing in the source continues 50 51"
        );
        follow(&mut h, &mut a, &mut edits, &[4]);
        assert_eq!(continue_copy(&h, &a, &edits, 3), Some(vec![5, 6, 7]));
        assert_eq!(
            edits.at(&[3], 0),
            Some(&Edit {
                from: vec![3],
                to: vec![50, 51]
            })
        );
    }

    #[test]
    fn a_learned_edit_is_drafted_at_the_next_occurrence() {
        // "x = 7 ; x + 1 ; x": renaming x (7) to 70 71.
        let src = [7, 1, 2, 9, 7, 3, 4, 9, 7, 5];
        let mut h = src.to_vec();
        let mut a = Alignment::copying_from(0);
        let mut edits = EditMemory::default();
        follow(&mut h, &mut a, &mut edits, &[70, 71, 1]);
        // The copy is back on the source after "1" and drafts the rest with the edit.
        assert_eq!(
            continue_copy(&h, &a, &edits, 9),
            Some(vec![2, 9, 70, 71, 3, 4, 9, 70, 71])
        );
        // Following the drafted edit keeps the alignment (the edit is confirmed).
        follow(&mut h, &mut a, &mut edits, &[2, 9, 70]);
        assert_eq!(continue_copy(&h, &a, &edits, 3), Some(vec![71, 3, 4]));
        follow(&mut h, &mut a, &mut edits, &[71]);
        assert_eq!(continue_copy(&h, &a, &edits, 2), Some(vec![3, 4]));
    }

    #[test]
    fn the_replacement_seen_most_often_wins() {
        let mut edits = EditMemory::default();
        let code = Edit {
            from: vec![7],
            to: vec![70, 71],
        };
        let prose = Edit {
            from: vec![7],
            to: vec![70, 72],
        };
        edits.learn(code.clone());
        edits.learn(code.clone());
        edits.learn(prose.clone());
        assert_eq!(edits.at(&[7, 1], 0), Some(&code), "seen twice against once");
        edits.learn(prose.clone());
        assert_eq!(
            edits.at(&[7, 1], 0),
            Some(&prose),
            "a tie goes to the newest"
        );
        let longer = Edit {
            from: vec![7, 1],
            to: vec![3],
        };
        edits.learn(longer.clone());
        assert_eq!(
            edits.at(&[7, 1], 0),
            Some(&longer),
            "the longest source first"
        );
        assert_eq!(edits.at(&[7, 2], 0), Some(&prose));
        assert_eq!(edits.at(&[7], 5), None, "past the end");
    }

    #[test]
    fn memory_is_bounded_and_forgets_the_least_seen() {
        let mut edits = EditMemory::default();
        let kept = Edit {
            from: vec![1],
            to: vec![2],
        };
        edits.learn(kept.clone());
        edits.learn(kept.clone());
        for t in 10..(10 + MAX_EDITS as u32 + 5) {
            edits.learn(Edit {
                from: vec![t],
                to: vec![t + 1000],
            });
        }
        assert_eq!(edits.len(), MAX_EDITS);
        assert_eq!(edits.at(&[1], 0), Some(&kept));
    }

    /// A fence inserted before the copied code ends in a newline, which the source has
    /// at the end of every line: matched there, it would carry the copy past the line
    /// the output is about to write, and no later resync looks back. One token matches
    /// only where the source it skips is about as long as what the output wrote.
    #[test]
    fn a_lone_common_token_does_not_carry_the_copy_past_the_line_being_written() {
        const NL: u32 = 1;
        const INDENT: u32 = 2;
        let source = [
            10, 11, 12, 13, 14, NL, INDENT, 20, 21, NL, INDENT, 30, 31, NL,
        ];
        let mut h = source.to_vec();
        h.push(99);
        let mut a = Alignment::copying_from(0);
        let mut edits = EditMemory::default();
        // "```python\n" before the code.
        follow(&mut h, &mut a, &mut edits, &[50, 51, NL]);
        assert_eq!(
            continue_copy(&h, &a, &edits, 3),
            None,
            "no newline five tokens on"
        );
        follow(&mut h, &mut a, &mut edits, &[10]);
        assert_eq!(continue_copy(&h, &a, &edits, 4), Some(vec![11, 12, 13, 14]));
        assert!(edits.is_empty(), "an insertion replaces nothing: {edits:?}");
        // A one-token replacement still rejoins at the next token.
        follow(
            &mut h,
            &mut a,
            &mut edits,
            &[11, 12, 13, 14, NL, INDENT, 77, 21],
        );
        assert_eq!(continue_copy(&h, &a, &edits, 3), Some(vec![NL, INDENT, 30]));
        assert_eq!(edits.at(&[20], 0).map(|e| e.to.clone()), Some(vec![77]));
    }

    #[test]
    fn a_copy_that_never_comes_back_is_dropped() {
        let mut h: Vec<u32> = (0..20).collect();
        let mut a = Alignment::copying_from(0);
        let mut edits = EditMemory::default();
        let unrelated: Vec<u32> = (500..500 + GIVE_UP_AFTER as u32).collect();
        follow(&mut h, &mut a, &mut edits, &unrelated);
        assert!(a.is_copying(), "still waiting after {GIVE_UP_AFTER} tokens");
        follow(&mut h, &mut a, &mut edits, &[999]);
        assert!(!a.is_copying());
        assert_eq!(continue_copy(&h, &a, &edits, 4), None);
        assert!(
            edits.is_empty(),
            "nothing came back, so nothing was learned"
        );
    }

    #[test]
    fn the_output_keeping_a_remembered_source_rejoins_at_once() {
        // 7 is usually renamed, but this occurrence is copied unchanged.
        let mut h = vec![1, 7, 2, 3, 4];
        let mut a = Alignment::copying_from(0);
        let mut edits = EditMemory::default();
        edits.learn(Edit {
            from: vec![7],
            to: vec![70],
        });
        follow(&mut h, &mut a, &mut edits, &[1, 7, 2]);
        assert_eq!(continue_copy(&h, &a, &edits, 2), Some(vec![3, 4]));
    }
}
