//! Downloads a hub model's files into the standard Hugging Face cache: only what dspec
//! reads (config, tokenizer, generation config, safetensors weights and their index),
//! resumable, with a progress bar on a terminal. `HF_ENDPOINT`, `HF_HOME` and
//! `HF_TOKEN` are honoured; `HF_HUB_OFFLINE=1` keeps to the cache.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use crate::loading::model_source::SourceError;

/// `org/name` with an optional `@revision` (a branch, tag or commit; default `main`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

impl HubId {
    pub fn parse(arg: &str) -> Self {
        match arg.split_once('@') {
            Some((repo, rev)) if !rev.is_empty() => Self {
                repo: repo.to_string(),
                revision: rev.to_string(),
            },
            _ => Self {
                repo: arg.trim_end_matches('@').to_string(),
                revision: "main".to_string(),
            },
        }
    }

    fn repo(&self) -> Repo {
        Repo::with_revision(self.repo.clone(), RepoType::Model, self.revision.clone())
    }

    fn display(&self) -> String {
        if self.revision == "main" {
            self.repo.clone()
        } else {
            format!("{}@{}", self.repo, self.revision)
        }
    }
}

/// Whether dspec reads `name` (a path in the repo): everything else (other formats'
/// weights, READMEs, images) stays on the hub.
pub fn is_needed(name: &str) -> bool {
    const FILES: [&str; 9] = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
        "chat_template.json",
        "model.safetensors.index.json",
    ];
    !name.contains('/') && (FILES.contains(&name) || name.ends_with(".safetensors"))
}

/// Whether `HF_HUB_OFFLINE` asks for the cache only (as huggingface_hub reads it).
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// The snapshot directory of `id` in the cache, when its download completed.
/// `config.json` is downloaded last, so its presence means every other file is there.
pub fn cached_dir(cache: &Cache, id: &HubId) -> Option<PathBuf> {
    cache
        .repo(id.repo())
        .get("config.json")
        .and_then(|p| p.parent().map(Path::to_path_buf))
}

/// Downloads what dspec needs of `id` into `cache` and returns its snapshot directory.
pub fn download(cache: &Cache, id: &HubId) -> Result<PathBuf, SourceError> {
    let failed = |file: &str, e: String| SourceError::Download {
        id: id.display(),
        file: file.to_string(),
        message: e,
    };
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
        .or_else(|| cache.token());
    let mut builder = ApiBuilder::from_cache(cache.clone())
        .with_token(token)
        .with_progress(std::io::stderr().is_terminal())
        .with_retries(2);
    if let Ok(endpoint) = std::env::var("HF_ENDPOINT") {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    let api = builder.build().map_err(|e| failed("", e.to_string()))?;
    let repo = api.repo(id.repo());
    let info = repo.info().map_err(|e| failed("", e.to_string()))?;
    let mut files: Vec<String> = info
        .siblings
        .into_iter()
        .map(|s| s.rfilename)
        .filter(|f| is_needed(f))
        .collect();
    if !files.iter().any(|f| f == "config.json") {
        return Err(failed(
            "config.json",
            "the repository has no config.json: it is not a model dspec loads".into(),
        ));
    }
    if !files.iter().any(|f| f.ends_with(".safetensors")) {
        return Err(failed(
            "*.safetensors",
            "the repository has no safetensors weights (a GGUF-only repo needs `dspec convert`)"
                .into(),
        ));
    }
    // config.json last: its presence in the cache marks a complete download.
    files.sort_by_key(|f| *f == "config.json");
    let cached = cache.repo(id.repo());
    let mut dir = None;
    for file in &files {
        let path = match cached.get(file) {
            Some(path) => path,
            None => repo
                .download(file)
                .map_err(|e| failed(file, e.to_string()))?,
        };
        dir = path.parent().map(Path::to_path_buf);
    }
    dir.ok_or_else(|| failed("", "no files were downloaded".into()))
}

/// The files of `id` the cache lacks, for the offline error (only what can be told
/// without the hub's file list).
pub fn missing_offline(cache: &Cache, id: &HubId) -> Vec<String> {
    let repo = cache.repo(id.repo());
    let mut missing: Vec<String> = ["config.json", "tokenizer.json"]
        .into_iter()
        .filter(|f| repo.get(f).is_none())
        .map(str::to_string)
        .collect();
    let has_weights = ["model.safetensors", "model.safetensors.index.json"]
        .iter()
        .any(|f| repo.get(f).is_some());
    if !has_weights {
        missing.push("model.safetensors (or its shards and index)".into());
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_take_an_optional_revision() {
        assert_eq!(
            HubId::parse("org/name"),
            HubId {
                repo: "org/name".into(),
                revision: "main".into()
            }
        );
        assert_eq!(
            HubId::parse("org/name@v1.0"),
            HubId {
                repo: "org/name".into(),
                revision: "v1.0".into()
            }
        );
        assert_eq!(HubId::parse("org/name@").revision, "main");
    }

    #[test]
    fn only_the_files_dspec_reads_are_fetched() {
        for name in [
            "config.json",
            "tokenizer.json",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "generation_config.json",
        ] {
            assert!(is_needed(name), "{name}");
        }
        for name in [
            "README.md",
            "pytorch_model.bin",
            "model.gguf",
            "onnx/model.safetensors",
            ".gitattributes",
        ] {
            assert!(!is_needed(name), "{name}");
        }
    }
}
