//! What a run writes: the drafter directory (`config.json` + `model.safetensors` in the
//! published schema, loaded by `dspec generate --drafter DIR`), and under `training/`
//! the full-precision parameters, the optimizer's moments and the step, which `--resume`
//! continues from.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use mlx_rs::{Array, Dtype};
use serde::{Deserialize, Serialize};

use super::net::Params;
use crate::error::EngineError;

type Result<T> = std::result::Result<T, EngineError>;

fn io(path: &Path, e: impl std::fmt::Display) -> EngineError {
    EngineError::Invalid(format!("{}: {e}", path.display()))
}

/// Writes `config`, and `params` with the `frozen` tensors the drafter keeps from the
/// target (cast to `dtype`), as a drafter directory.
pub fn write_drafter(
    dir: &Path,
    config: &serde_json::Value,
    params: &Params,
    frozen: &[(String, Array)],
    dtype: Dtype,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let weights = params
        .iter()
        .map(|(name, p)| (name.to_string(), p))
        .chain(frozen.iter().map(|(name, p)| (name.clone(), p)))
        .map(|(name, p)| Ok((name, p.as_dtype(dtype)?)))
        .collect::<Result<HashMap<String, Array>>>()?;
    let path = dir.join("model.safetensors");
    Array::save_safetensors(weights.iter(), None, &path).map_err(|e| io(&path, e))?;
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(config).map_err(|e| io(&path, e))?;
    std::fs::write(&path, text).map_err(|e| io(&path, e))
}

/// What `--resume` checks and continues from: the settings that decide what every step
/// computes, and how many steps are done.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    pub step: usize,
    /// The flags a resumed run must repeat (JSON, by flag name).
    pub settings: serde_json::Map<String, serde_json::Value>,
}

pub fn state_dir(out: &Path) -> PathBuf {
    out.join("training")
}

/// Saves parameters, optimizer moments and the run's state; the state file goes last,
/// so a run cut short while saving resumes from the save before.
pub fn save_state(
    out: &Path,
    params: &Params,
    moments: &HashMap<Rc<str>, (Array, Array)>,
    state: &RunState,
) -> Result<()> {
    let dir = state_dir(out);
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
    let path = dir.join("params.safetensors");
    Array::save_safetensors(params.iter().map(|(k, v)| (k.as_ref(), v)), None, &path)
        .map_err(|e| io(&path, e))?;
    let mut flat: Vec<(String, &Array)> = Vec::new();
    for (name, (m, v)) in moments {
        flat.push((format!("m.{name}"), m));
        flat.push((format!("v.{name}"), v));
    }
    let path = dir.join("optimizer.safetensors");
    Array::save_safetensors(flat, None, &path).map_err(|e| io(&path, e))?;
    let path = dir.join("state.json");
    let text = serde_json::to_string_pretty(state).map_err(|e| io(&path, e))?;
    std::fs::write(&path, text).map_err(|e| io(&path, e))
}

/// What [`save_state`] wrote under `out`.
pub struct Saved {
    pub params: Params,
    pub moments: HashMap<Rc<str>, (Array, Array)>,
    pub state: RunState,
}

pub fn load_state(out: &Path) -> Result<Saved> {
    let dir = state_dir(out);
    let path = dir.join("state.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        EngineError::Invalid(format!(
            "--resume: {}: {e}; resume needs the --out directory of an earlier run",
            path.display()
        ))
    })?;
    let state: RunState = serde_json::from_str(&text).map_err(|e| {
        io(
            &path,
            format!("not a training state ({e}); start without --resume"),
        )
    })?;
    let read = |name: &str| -> Result<HashMap<String, Array>> {
        let path = dir.join(name);
        Array::load_safetensors(&path)
            .map_err(|e| io(&path, format!("{e}; start without --resume")))
    };
    let params = read("params.safetensors")?
        .into_iter()
        .map(|(k, v)| (Rc::from(k.as_str()), v))
        .collect();
    let mut halves: HashMap<String, (Option<Array>, Option<Array>)> = HashMap::new();
    for (key, value) in read("optimizer.safetensors")? {
        match key.split_once('.') {
            Some(("m", name)) => halves.entry(name.to_string()).or_default().0 = Some(value),
            Some(("v", name)) => halves.entry(name.to_string()).or_default().1 = Some(value),
            _ => {
                return Err(io(
                    &dir.join("optimizer.safetensors"),
                    format!("unexpected tensor `{key}`"),
                ))
            }
        }
    }
    let moments = halves
        .into_iter()
        .map(|(name, pair)| match pair {
            (Some(m), Some(v)) => Ok((Rc::from(name.as_str()), (m, v))),
            _ => Err(io(
                &dir.join("optimizer.safetensors"),
                format!("`{name}` lacks one of its two moments; start without --resume"),
            )),
        })
        .collect::<Result<_>>()?;
    Ok(Saved {
        params,
        moments,
        state,
    })
}
