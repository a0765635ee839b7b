//! Batches for `dspec score`: requests from a JSONL file (errors name the file and
//! line) or from flags, run on the base model, the adapted one or both (with deltas),
//! and the results as JSON or as text tables.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::scoring::{Measure, Score, Scorer, Variant};

/// One thing to score, with where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreRequest {
    /// 1-based line in the JSONL file, when read from one.
    pub line: Option<usize>,
    /// Echoed back untouched, for matching results to inputs.
    pub id: Option<serde_json::Value>,
    pub measure: Measure,
}

/// A JSONL line as written: `measure` picks which of the other fields are needed.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonlLine {
    measure: String,
    prompt: Option<String>,
    completion: Option<String>,
    text: Option<String>,
    k: Option<usize>,
    id: Option<serde_json::Value>,
}

/// Reads `path`: one JSON object per line (blank lines skipped), e.g.
/// `{"measure": "logprob", "prompt": "…", "completion": "…"}`,
/// `{"measure": "rolling", "text": "…"}`,
/// `{"measure": "next-token", "prompt": "…", "k": 10}` (`k` defaults to `default_k`);
/// any line may carry an `id`.
pub fn read_requests(path: &Path, default_k: usize) -> Result<Vec<ScoreRequest>, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        EngineError::Invalid(format!("cannot read --input {}: {e}", path.display()))
    })?;
    let mut requests = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let request = parse_line(line, i + 1, default_k).map_err(|message| {
            EngineError::Invalid(format!("{}:{}: {message}", path.display(), i + 1))
        })?;
        requests.push(request);
    }
    if requests.is_empty() {
        return Err(EngineError::Invalid(format!(
            "{}: no requests (one JSON object per line, e.g. {{\"measure\": \"rolling\", \"text\": \"...\"}})",
            path.display()
        )));
    }
    Ok(requests)
}

fn parse_line(line: &str, number: usize, default_k: usize) -> Result<ScoreRequest, String> {
    let parsed: JsonlLine = serde_json::from_str(line).map_err(|e| {
        format!("{e} (expected an object with `measure` and its fields: prompt/completion, text, or prompt/k)")
    })?;
    let need = |field: Option<String>, name: &str| {
        field.ok_or_else(|| format!("measure `{}` needs `{name}`", parsed.measure))
    };
    let unused = |fields: &[(&str, bool)]| match fields.iter().find(|(_, set)| *set) {
        Some((name, _)) => Err(format!(
            "`{name}` does not belong to measure `{}`",
            parsed.measure
        )),
        None => Ok(()),
    };
    let measure = match parsed.measure.as_str() {
        "logprob" => {
            unused(&[("text", parsed.text.is_some()), ("k", parsed.k.is_some())])?;
            Measure::Logprob {
                prompt: need(parsed.prompt.clone(), "prompt")?,
                completion: need(parsed.completion.clone(), "completion")?,
            }
        }
        "rolling" => {
            unused(&[
                ("prompt", parsed.prompt.is_some()),
                ("completion", parsed.completion.is_some()),
                ("k", parsed.k.is_some()),
            ])?;
            Measure::Rolling {
                text: need(parsed.text.clone(), "text")?,
            }
        }
        "next-token" => {
            unused(&[
                ("text", parsed.text.is_some()),
                ("completion", parsed.completion.is_some()),
            ])?;
            Measure::NextToken {
                prompt: need(parsed.prompt.clone(), "prompt")?,
                k: parsed.k.unwrap_or(default_k),
            }
        }
        other => {
            return Err(format!(
                "unknown measure `{other}` (logprob, rolling, next-token)"
            ))
        }
    };
    Ok(ScoreRequest {
        line: Some(number),
        id: parsed.id,
        measure,
    })
}

/// Which model(s) answer each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sides {
    One(Variant),
    /// Base and adapted, with adapted − base deltas.
    Compare,
}

/// Adapted − base, for `--compare`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoreDelta {
    /// logprob: of the sum; rolling: of the total.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprob: Option<f64>,
    /// Per scored token (both sides score the same tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_token: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    /// next-token: whether the most likely token differs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_token_changed: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoreResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<serde_json::Value>,
    #[serde(flatten)]
    pub measure: Measure,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<Score>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapted: Option<Score>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<ScoreDelta>,
}

/// Scores the requests on `sides` in order, asking `stop` before each: true ends the run
/// there, with the results so far (fewer than the requests). A failing request stops the
/// run, named by its line (or position).
pub fn run_requests(
    scorer: &mut Scorer,
    requests: &[ScoreRequest],
    sides: Sides,
    stop: &dyn Fn() -> bool,
) -> Result<Vec<ScoreResult>, EngineError> {
    let mut results = Vec::with_capacity(requests.len());
    for (i, request) in requests.iter().enumerate() {
        if stop() {
            break;
        }
        let result = run_one(scorer, request, sides).map_err(|e| {
            let place = match request.line {
                Some(line) => format!("line {line}"),
                None => format!("request {}", i + 1),
            };
            EngineError::Invalid(format!("{place} ({}): {e}", request.measure.name()))
        })?;
        results.push(result);
    }
    Ok(results)
}

fn run_one(
    scorer: &mut Scorer,
    request: &ScoreRequest,
    sides: Sides,
) -> Result<ScoreResult, EngineError> {
    let mut score = |variant| scorer.score(&request.measure, variant);
    let (base, adapted) = match sides {
        Sides::One(Variant::Base) => (Some(score(Variant::Base)?), None),
        Sides::One(Variant::Adapted) => (None, Some(score(Variant::Adapted)?)),
        Sides::Compare => (Some(score(Variant::Base)?), Some(score(Variant::Adapted)?)),
    };
    let delta = match (&base, &adapted) {
        (Some(b), Some(a)) => Some(delta(b, a)),
        _ => None,
    };
    Ok(ScoreResult {
        line: request.line,
        id: request.id.clone(),
        measure: request.measure.clone(),
        base,
        adapted,
        delta,
    })
}

fn delta(base: &Score, adapted: &Score) -> ScoreDelta {
    let none = ScoreDelta {
        logprob: None,
        per_token: None,
        perplexity: None,
        top_token_changed: None,
    };
    let per_token = |b: &[crate::scoring::TokenLogprob], a: &[crate::scoring::TokenLogprob]| {
        Some(
            b.iter()
                .zip(a)
                .map(|(b, a)| a.logprob - b.logprob)
                .collect(),
        )
    };
    match (base, adapted) {
        (Score::Logprob(b), Score::Logprob(a)) => ScoreDelta {
            logprob: Some(a.sum - b.sum),
            per_token: per_token(&b.tokens, &a.tokens),
            ..none
        },
        (Score::Rolling(b), Score::Rolling(a)) => ScoreDelta {
            logprob: Some(a.total - b.total),
            per_token: per_token(&b.tokens, &a.tokens),
            perplexity: a.perplexity.zip(b.perplexity).map(|(a, b)| a - b),
            ..none
        },
        (Score::NextToken(b), Score::NextToken(a)) => ScoreDelta {
            top_token_changed: Some(b.top.first().map(|t| t.id) != a.top.first().map(|t| t.id)),
            ..none
        },
        _ => none,
    }
}

/// The results as text: a header line per request, then a table with one column per
/// model (and the delta when comparing).
pub fn render_text(results: &[ScoreResult]) -> String {
    let mut out = String::new();
    for (i, r) in results.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let place = r
            .line
            .map_or(format!("[{}]", i + 1), |l| format!("[line {l}]"));
        let _ = writeln!(out, "{place} {}", describe(&r.measure));
        let sides: Vec<(&str, &Score)> = [("base", &r.base), ("adapted", &r.adapted)]
            .into_iter()
            .filter_map(|(name, s)| s.as_ref().map(|s| (name, s)))
            .collect();
        out.push_str(&table(&sides));
    }
    out
}

fn describe(measure: &Measure) -> String {
    match measure {
        Measure::Logprob { prompt, completion } => {
            format!("logprob  prompt {prompt:?}  completion {completion:?}")
        }
        Measure::Rolling { text } => format!("rolling  text {:?}", shorten(text, 60)),
        Measure::NextToken { prompt, k } => format!("next-token  prompt {prompt:?}  top {k}"),
    }
}

fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// Rows of (label, one value per side); with two sides a delta column is added.
fn table(sides: &[(&str, &Score)]) -> String {
    let rows: Vec<(String, Vec<String>)> = match sides.first().map(|s| s.1) {
        Some(Score::NextToken(_)) => return next_token_table(sides),
        Some(Score::Logprob(_)) | Some(Score::Rolling(_)) => token_rows(sides),
        None => Vec::new(),
    };
    let mut header = vec!["".to_string()];
    header.extend(sides.iter().map(|(name, _)| name.to_string()));
    if sides.len() == 2 {
        header.push("delta".into());
    }
    let mut lines = vec![header];
    lines.extend(rows.into_iter().map(|(label, values)| {
        let mut line = vec![label];
        line.extend(values);
        line
    }));
    align(&lines, |c| c == 0)
}

/// Per-token log-probabilities, then the sum (and perplexity for rolling).
fn token_rows(sides: &[(&str, &Score)]) -> Vec<(String, Vec<String>)> {
    let tokens = |s: &Score| match s {
        Score::Logprob(l) => l.tokens.clone(),
        Score::Rolling(r) => r.tokens.clone(),
        Score::NextToken(_) => Vec::new(),
    };
    let columns: Vec<Vec<f64>> = sides
        .iter()
        .map(|(_, s)| tokens(s).iter().map(|t| t.logprob).collect())
        .collect();
    let labels: Vec<String> = sides
        .first()
        .map(|(_, s)| tokens(s).iter().map(|t| format!("{:?}", t.token)).collect())
        .unwrap_or_default();
    let mut rows: Vec<(String, Vec<f64>)> = labels
        .into_iter()
        .enumerate()
        .map(|(i, label)| (label, columns.iter().map(|c| c[i]).collect()))
        .collect();
    let totals: Vec<f64> = sides
        .iter()
        .map(|(_, s)| match s {
            Score::Logprob(l) => l.sum,
            Score::Rolling(r) => r.total,
            Score::NextToken(_) => 0.0,
        })
        .collect();
    let is_rolling = matches!(sides.first(), Some((_, Score::Rolling(_))));
    rows.push((if is_rolling { "total" } else { "sum" }.into(), totals));
    let mut rendered: Vec<(String, Vec<String>)> = rows
        .into_iter()
        .map(|(label, values)| (label, with_delta(&values, |v| format!("{v:.4}"))))
        .collect();
    if is_rolling {
        let ppl: Vec<Option<f64>> = sides
            .iter()
            .map(|(_, s)| match s {
                Score::Rolling(r) => r.perplexity,
                _ => None,
            })
            .collect();
        if ppl.iter().all(Option::is_some) {
            let values: Vec<f64> = ppl.into_iter().flatten().collect();
            rendered.push((
                "perplexity".into(),
                with_delta(&values, |v| format!("{v:.3}")),
            ));
        }
        let count = sides.first().map_or(0, |(_, s)| tokens(s).len());
        rendered.push(("tokens".into(), vec![count.to_string(); sides.len()]));
    }
    rendered
}

/// Formats each value, adding `adapted − base` when there are two.
fn with_delta(values: &[f64], fmt: impl Fn(f64) -> String) -> Vec<String> {
    let mut cells: Vec<String> = values.iter().map(|&v| fmt(v)).collect();
    if let [b, a] = values {
        cells.push(format!("{:+.4}", a - b));
    }
    cells
}

/// Rank by rank: token and probability under each side, then the tail mass.
fn next_token_table(sides: &[(&str, &Score)]) -> String {
    let dists: Vec<_> = sides
        .iter()
        .filter_map(|(name, s)| match s {
            Score::NextToken(n) => Some((*name, n)),
            _ => None,
        })
        .collect();
    let mut header = vec!["rank".to_string()];
    for (name, _) in &dists {
        header.push(format!("{name} token"));
        header.push("prob".into());
    }
    let mut lines = vec![header];
    let ranks = dists.iter().map(|(_, d)| d.top.len()).max().unwrap_or(0);
    for rank in 0..ranks {
        let mut line = vec![(rank + 1).to_string()];
        for (_, d) in &dists {
            match d.top.get(rank) {
                Some(t) => {
                    line.push(format!("{:?}", t.token));
                    line.push(format!("{:.4}", t.prob));
                }
                None => line.extend(["".to_string(), "".to_string()]),
            }
        }
        lines.push(line);
    }
    let mut tail = vec!["tail".to_string()];
    for (_, d) in &dists {
        tail.push("".into());
        tail.push(d.tail_mass.map_or("-".into(), |m| format!("{m:.4}")));
    }
    lines.push(tail);
    // Token columns (1, 3) read best left-aligned, numbers right-aligned.
    align(&lines, |c| c % 2 == 1)
}

/// Pads cells into columns two spaces apart: left-aligned where `left(column)`,
/// right-aligned elsewhere.
fn align(lines: &[Vec<String>], left: impl Fn(usize) -> bool) -> String {
    let columns = lines.iter().map(Vec::len).max().unwrap_or(0);
    let width = |c: usize| {
        lines
            .iter()
            .filter_map(|l| l.get(c))
            .map(|s| s.chars().count())
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..columns).map(width).collect();
    let mut out = String::new();
    for line in lines {
        let cells: Vec<String> = line
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                let pad = widths[c].saturating_sub(cell.chars().count());
                if left(c) {
                    format!("{cell}{}", " ".repeat(pad))
                } else {
                    format!("{}{cell}", " ".repeat(pad))
                }
            })
            .collect();
        let _ = writeln!(out, "  {}", cells.join("  ").trim_end());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_lines_become_requests_and_bad_lines_say_why() {
        let ok = parse_line(r#"{"measure":"next-token","prompt":"Hi","id":7}"#, 3, 10).unwrap();
        assert_eq!(
            ok,
            ScoreRequest {
                line: Some(3),
                id: Some(serde_json::json!(7)),
                measure: Measure::NextToken {
                    prompt: "Hi".into(),
                    k: 10
                },
            }
        );
        for (line, says) in [
            (
                r#"{"measure":"logprob","prompt":"a"}"#,
                "needs `completion`",
            ),
            (
                r#"{"measure":"rolling","text":"a","k":3}"#,
                "`k` does not belong",
            ),
            (r#"{"measure":"perplexity","text":"a"}"#, "unknown measure"),
            (r#"{"measure":"rolling","txt":"a"}"#, "unknown field"),
            ("not json", "expected"),
        ] {
            let e = parse_line(line, 1, 10).unwrap_err();
            assert!(e.contains(says), "{line}: {e}");
        }
    }

    #[test]
    fn read_requests_names_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(
            &path,
            "{\"measure\":\"rolling\",\"text\":\"a\"}\n\n{\"measure\":\"logprob\"}\n",
        )
        .unwrap();
        let e = read_requests(&path, 5).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{}:3:", path.display())) && e.contains("needs `prompt`"),
            "{e}"
        );
    }
}
