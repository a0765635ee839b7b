//! Turns `--target`/`--drafter` into a model directory: a local path, or a Hugging
//! Face hub id `org/name[@revision]`, taken from the local hub cache or downloaded
//! into it (see [`crate::loading::hub`]).

use std::path::{Path, PathBuf};

use crate::loading::hub::{cached_dir, download, missing_offline, offline, HubId};

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{0}: no such directory")]
    NotFound(PathBuf),
    #[error("{0} is a file; --target wants a model directory (config.json, tokenizer.json, *.safetensors). For a .gguf file run `dspec convert {0} OUT_DIR` first")]
    NotADirectory(PathBuf),
    #[error(
        "`{id}` is not a local directory and not in the Hugging Face cache ({cache}), and \
         HF_HUB_OFFLINE is set, so dspec does not download it; missing: {}.\n\
         Unset HF_HUB_OFFLINE to download it, or on a machine with network access run\n  \
         huggingface-cli download {download_args}\nand copy the cache here (or set HF_HOME), or pass a \
         local model directory.",
        missing.join(", ")
    )]
    NotCached {
        id: String,
        /// What `huggingface-cli download` takes for this id.
        download_args: String,
        cache: String,
        missing: Vec<String>,
    },
    #[error(
        "downloading `{id}`{}: {message}.\nCheck the id and revision (org/name@revision), set \
         HF_TOKEN for a gated or private model, HF_ENDPOINT for a mirror, or HF_HUB_OFFLINE=1 \
         to use the cache only.",
        if file.is_empty() { String::new() } else { format!(" ({file})") }
    )]
    Download {
        id: String,
        file: String,
        message: String,
    },
}

/// Whether `s` looks like `org/name[@revision]` rather than a path.
fn looks_like_hub_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.len() == 2
        && parts
            .iter()
            .all(|p| !p.is_empty() && *p != "." && *p != "..")
        && !s.starts_with('.')
        && !s.starts_with('~')
}

/// Resolves a model argument to a directory.
pub fn resolve_model_dir(arg: &str) -> Result<PathBuf, SourceError> {
    let path = Path::new(arg);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.is_file() {
        return Err(SourceError::NotADirectory(path.to_path_buf()));
    }
    if !looks_like_hub_id(arg) {
        return Err(SourceError::NotFound(path.to_path_buf()));
    }
    let id = HubId::parse(arg);
    let cache = hf_hub::Cache::from_env();
    if let Some(dir) = cached_dir(&cache, &id) {
        return Ok(dir);
    }
    if offline() {
        return Err(SourceError::NotCached {
            id: arg.to_string(),
            download_args: match id.revision.as_str() {
                "main" => id.repo.clone(),
                rev => format!("{} --revision {rev}", id.repo),
            },
            cache: cache.path().display().to_string(),
            missing: missing_offline(&cache, &id),
        });
    }
    download(&cache, &id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_dirs_resolve_to_themselves_and_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            resolve_model_dir(dir.path().to_str().unwrap()).unwrap(),
            dir.path()
        );
        let file = dir.path().join("model.gguf");
        std::fs::write(&file, b"x").unwrap();
        let err = resolve_model_dir(file.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("dspec convert"), "{err}");
    }

    #[test]
    fn hub_ids_are_looked_up_in_the_cache_with_a_clear_error_when_missing() {
        let home = tempfile::tempdir().unwrap();
        // A snapshot laid out as hf-hub's cache does.
        let repo = home.path().join("hub/models--org--tiny");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "abc123").unwrap();
        std::fs::create_dir_all(repo.join("snapshots/abc123")).unwrap();
        std::fs::write(repo.join("snapshots/abc123/config.json"), "{}").unwrap();
        std::env::set_var("HF_HOME", home.path());
        // Never the real hub from a unit test.
        std::env::set_var("HF_HUB_OFFLINE", "1");
        assert_eq!(
            resolve_model_dir("org/tiny").unwrap(),
            repo.join("snapshots/abc123")
        );
        let err = resolve_model_dir("org/absent").unwrap_err().to_string();
        assert!(
            err.contains("not in the Hugging Face cache")
                && err.contains("HF_HUB_OFFLINE")
                && err.contains("config.json")
                && err.contains("huggingface-cli download org/absent"),
            "{err}"
        );
        assert!(matches!(
            resolve_model_dir("./nope/x"),
            Err(SourceError::NotFound(_))
        ));
    }
}
