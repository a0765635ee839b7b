//! Which adapter builds which model: registrations submitted through `inventory` by
//! built-in families (and, later, entries added by plugins), keyed on config.json's
//! `model_type`. A key claimed twice is an error, never a silent override.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{ModelError, Result};
use crate::target::{LoadRequest, TargetModel};

/// Constructor of an adapter: builds a model from a checkpoint directory.
pub type LoadFn = fn(&LoadRequest) -> Result<Box<dyn TargetModel>>;

/// A built-in family's registration, submitted with `inventory::submit!`.
pub struct AdapterRegistration {
    /// Adapter name shown to users (usually the primary model_type).
    pub name: &'static str,
    /// config.json `model_type` values this adapter owns.
    pub model_types: &'static [&'static str],
    /// Other spellings that resolve here when no adapter owns them as a model_type.
    pub aliases: &'static [&'static str],
    /// HF `architectures` entries, consulted when model_type matches nothing.
    pub architectures: &'static [&'static str],
    pub load: LoadFn,
}

inventory::collect!(AdapterRegistration);

/// A constructor shared between registry copies (built-in fn or plugin closure).
pub type SharedLoadFn = Arc<dyn Fn(&LoadRequest) -> Result<Box<dyn TargetModel>> + Send + Sync>;

/// Where an adapter comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum AdapterSource {
    BuiltIn,
    Plugin { path: PathBuf, abi_version: u32 },
}

impl fmt::Display for AdapterSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdapterSource::BuiltIn => f.write_str("built-in"),
            AdapterSource::Plugin { path, abi_version } => {
                write!(f, "plugin {} (ABI v{abi_version})", path.display())
            }
        }
    }
}

/// One adapter as the registry knows it, built-in or from a plugin.
#[derive(Clone)]
pub struct AdapterEntry {
    pub name: String,
    pub model_types: Vec<String>,
    pub aliases: Vec<String>,
    pub architectures: Vec<String>,
    pub source: AdapterSource,
    pub load: SharedLoadFn,
}

impl AdapterEntry {
    fn from_registration(r: &AdapterRegistration) -> Self {
        let load = r.load;
        Self {
            name: r.name.to_string(),
            model_types: r.model_types.iter().map(|s| s.to_string()).collect(),
            aliases: r.aliases.iter().map(|s| s.to_string()).collect(),
            architectures: r.architectures.iter().map(|s| s.to_string()).collect(),
            source: AdapterSource::BuiltIn,
            load: Arc::new(load),
        }
    }
}

/// How a model directory was matched to an adapter.
pub struct Detection<'a> {
    pub adapter: &'a AdapterEntry,
    pub model_type: String,
    /// Human-readable reason, e.g. `model_type "qwen2" is owned by adapter qwen2`.
    pub reason: String,
    pub config: serde_json::Value,
}

#[derive(Default, Clone)]
pub struct AdapterRegistry {
    entries: Vec<AdapterEntry>,
}

impl AdapterRegistry {
    /// Every adapter linked into this binary.
    pub fn builtin() -> Result<Self> {
        let mut registry = Self::default();
        let mut regs: Vec<&AdapterRegistration> =
            inventory::iter::<AdapterRegistration>.into_iter().collect();
        regs.sort_by_key(|r| r.name);
        for r in regs {
            registry.add(AdapterEntry::from_registration(r), false)?;
        }
        Ok(registry)
    }

    /// Adds an adapter. A model_type already owned by another adapter is an error unless
    /// `replace` is set, in which case the new entry takes those keys over.
    pub fn add(&mut self, entry: AdapterEntry, replace: bool) -> Result<()> {
        for key in &entry.model_types {
            if let Some(owner) = self
                .entries
                .iter_mut()
                .find(|e| e.model_types.contains(key))
            {
                if !replace {
                    return Err(ModelError::DuplicateRegistration {
                        key: key.clone(),
                        first: format!("{} ({})", owner.name, owner.source),
                        second: format!("{} ({})", entry.name, entry.source),
                    });
                }
                owner.model_types.retain(|k| k != key);
            }
        }
        self.entries.retain(|e| !e.model_types.is_empty());
        self.entries.push(entry);
        Ok(())
    }

    pub fn entries(&self) -> &[AdapterEntry] {
        &self.entries
    }

    /// All model_type keys, sorted, for messages.
    pub fn model_types(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .entries
            .iter()
            .flat_map(|e| e.model_types.iter().cloned())
            .collect();
        keys.sort();
        keys
    }

    /// Reads `dir/config.json` and finds its adapter: by model_type, then alias, then architectures.
    pub fn detect(&self, dir: &Path) -> Result<Detection<'_>> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(ModelError::config(
                &path,
                "not found: --target must be a model directory with config.json, tokenizer.json and *.safetensors",
            ));
        }
        let config = read_json(&path)?;
        let model_type = config["model_type"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let architectures: Vec<String> = config["architectures"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();

        let found = self
            .entries
            .iter()
            .find(|e| e.model_types.contains(&model_type))
            .map(|e| {
                (
                    e,
                    format!(
                        "model_type \"{model_type}\" is owned by adapter {} ({})",
                        e.name, e.source
                    ),
                )
            })
            .or_else(|| {
                self.entries
                    .iter()
                    .find(|e| e.aliases.contains(&model_type))
                    .map(|e| {
                        (
                            e,
                            format!(
                                "model_type \"{model_type}\" is an alias of adapter {} ({})",
                                e.name, e.source
                            ),
                        )
                    })
            })
            .or_else(|| {
                architectures.iter().find_map(|arch| {
                    self.entries
                        .iter()
                        .find(|e| e.architectures.contains(arch))
                        .map(|e| {
                            (
                                e,
                                format!(
                                    "architecture \"{arch}\" is handled by adapter {} ({})",
                                    e.name, e.source
                                ),
                            )
                        })
                })
            });
        match found {
            Some((adapter, reason)) => Ok(Detection {
                adapter,
                model_type,
                reason,
                config,
            }),
            None => Err(ModelError::UnknownModelType {
                model_type: if model_type.is_empty() {
                    "<missing>".into()
                } else {
                    model_type
                },
                path,
                registered: self.model_types().join(", "),
            }),
        }
    }
}

/// Reads a JSON file (a checkpoint's config.json), with the path in the error a user
/// needs to fix it.
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::config(path, format!("invalid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, keys: &[&str]) -> AdapterEntry {
        AdapterEntry {
            name: name.into(),
            model_types: keys.iter().map(|s| s.to_string()).collect(),
            aliases: vec![],
            architectures: vec!["FooForCausalLM".into()],
            source: AdapterSource::BuiltIn,
            load: Arc::new(|_| Err(ModelError::Unsupported("test".into()))),
        }
    }

    #[test]
    fn duplicate_model_type_is_rejected_unless_replacing() {
        let mut reg = AdapterRegistry::default();
        reg.add(entry("a", &["foo", "bar"]), false).unwrap();
        let err = reg
            .add(entry("b", &["bar"]), false)
            .expect_err("duplicate must fail");
        assert!(
            err.to_string().contains("`bar` is registered twice"),
            "{err}"
        );
        reg.add(entry("b", &["bar"]), true).unwrap();
        assert_eq!(reg.entries().len(), 2);
        assert_eq!(reg.entries()[0].model_types, vec!["foo".to_string()]);
    }

    #[test]
    #[allow(clippy::err_expect)] // Detection holds a trait object and has no Debug.
    fn detect_reports_unknown_model_type_with_the_registered_list() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), r#"{"model_type": "nope"}"#).unwrap();
        let mut reg = AdapterRegistry::default();
        reg.add(entry("a", &["foo"]), false).unwrap();
        let err = reg
            .detect(dir.path())
            .err()
            .expect("unknown must fail")
            .to_string();
        assert!(
            err.contains("`nope`") && err.contains("foo") && err.contains("adapters/src"),
            "{err}"
        );
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type": "x", "architectures": ["FooForCausalLM"]}"#,
        )
        .unwrap();
        let found = reg.detect(dir.path()).unwrap();
        assert!(found.reason.contains("architecture"), "{}", found.reason);
    }

    #[test]
    fn detect_without_config_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = AdapterRegistry::default()
            .detect(dir.path())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("config.json") && err.contains("not found"),
            "{err}"
        );
    }
}
