//! `--drafter replay:FILE`: drafts a known answer, the `tokens` of an earlier
//! `dspec generate --json` run. A run that repeats that one (same target, prompt and
//! greedy decoding) keeps every draft, so it measures the best case of speculation on a
//! device: what a round of w positions costs when nothing is rejected, and how far
//! above plain decoding rounds can go. Once the output leaves the answer replayed,
//! nothing more is drafted.

use std::path::Path;

use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::{Draft, Drafter, ModelError, TargetModel, TokenPicker};

pub struct ReplayDrafter {
    /// The answer replayed, from its first generated token.
    answer: Vec<u32>,
    /// Tokens committed so far: the next to feed is `answer[seen]` while the output
    /// follows the answer.
    seen: usize,
}

impl ReplayDrafter {
    pub fn new(answer: Vec<u32>) -> Self {
        Self { answer, seen: 0 }
    }

    /// Reads the `tokens` array of a `dspec generate --json` output (or a bare JSON
    /// array of ids), every id below `vocab_size`.
    pub fn from_file(path: &Path, vocab_size: usize) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |what: String| {
            ModelError::config(
                path,
                format!(
                    "{what}; --drafter replay:FILE takes the output of `dspec generate --json`"
                ),
            )
        };
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON ({e})")))?;
        let ids = match value.get("tokens").unwrap_or(&value) {
            serde_json::Value::Array(ids) => ids,
            _ => return Err(bad("no `tokens` array".into())),
        };
        let answer = ids
            .iter()
            .map(|id| match id.as_u64() {
                Some(id) if (id as usize) < vocab_size => Ok(id as u32),
                _ => Err(bad(format!(
                    "token {id} is not an id of the target's {vocab_size}-token vocabulary"
                ))),
            })
            .collect::<Result<Vec<u32>>>()?;
        Ok(Self::new(answer))
    }
}

impl Drafter for ReplayDrafter {
    fn name(&self) -> &str {
        "replay"
    }

    fn begin(&mut self, _: &dyn TargetModel, _: &[u32], _: Option<&Array>) -> Result<()> {
        self.seen = 0;
        Ok(())
    }

    fn propose(
        &mut self,
        _target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        _picker: &mut dyn TokenPicker,
    ) -> Result<Draft> {
        let tokens = match self.answer.get(self.seen) {
            Some(&expected) if expected == last => {
                let from = self.seen + 1;
                let to = (from + max_k).min(self.answer.len());
                self.answer.get(from..to).unwrap_or_default().to_vec()
            }
            _ => Vec::new(),
        };
        Ok(Draft {
            tokens,
            ..Draft::default()
        })
    }

    fn commit(&mut self, verified: &[u32], _hidden: Option<&Array>) -> Result<()> {
        self.seen += verified.len();
        Ok(())
    }

    /// A proposal reads the answer at the position committed, changing nothing.
    fn drafts_by_lookup(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(file: &str, vocab: usize) -> Result<Vec<u32>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("answer.json");
        std::fs::write(&path, file).unwrap();
        ReplayDrafter::from_file(&path, vocab).map(|d| d.answer)
    }

    #[test]
    fn reads_the_tokens_of_a_generate_output_or_a_bare_array() {
        assert_eq!(
            ids(r#"{"text": "hi", "tokens": [5, 6, 7]}"#, 10).unwrap(),
            [5, 6, 7]
        );
        assert_eq!(ids("[1, 2]", 10).unwrap(), [1, 2]);
    }

    #[test]
    fn refuses_what_is_not_an_answer_of_this_target() {
        for (file, says) in [
            ("not json", "invalid JSON"),
            (r#"{"text": "hi"}"#, "no `tokens` array"),
            (r#"{"tokens": [3, 10]}"#, "token 10"),
            (r#"{"tokens": [3, -1]}"#, "token -1"),
        ] {
            let err = ids(file, 10).expect_err(file).to_string();
            assert!(
                err.contains(says) && err.contains("answer.json"),
                "{file}: {err}"
            );
        }
    }
}
