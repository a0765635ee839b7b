//! Finds adapter plugins and adds their families to the registry next to the built-ins.
//! Search order: `--plugin FILE`s, then `$DSPEC_PLUGIN_PATH` directories, then the
//! per-user plugin directory; a model_type a built-in also claims needs `--plugin-override`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dspec_plugin_api::plugin::{load_plugin, PluginLibrary};
use dspec_plugin_api::{AdapterRegistry, AdapterSource, ModelError};
use dspec_runtime::files::xdg_dir;

use crate::error::EngineError;
use crate::loading::builtin_registry;

/// Directories listed here (like `PATH`) are searched for plugin libraries.
pub const PLUGIN_PATH_ENV: &str = "DSPEC_PLUGIN_PATH";

/// What the user asked for on the command line.
#[derive(Debug, Clone, Default)]
pub struct PluginOptions {
    /// `--plugin FILE`, in order.
    pub files: Vec<PathBuf>,
    /// `--plugin-override`: a plugin may take model_types from built-in adapters.
    pub override_builtin: bool,
}

/// Where plugins are looked for besides `--plugin`; taken from the environment by
/// [`PluginSearch::from_env`], or given explicitly (tests).
#[derive(Debug, Clone, Default)]
pub struct PluginSearch {
    /// `$DSPEC_PLUGIN_PATH`'s directories.
    pub path_dirs: Vec<PathBuf>,
    /// The per-user plugin directory, if one can be named.
    pub user_dir: Option<PathBuf>,
}

impl PluginSearch {
    pub fn from_env() -> Self {
        Self {
            path_dirs: std::env::var_os(PLUGIN_PATH_ENV)
                .map(|v| {
                    std::env::split_paths(&v)
                        .filter(|p| !p.as_os_str().is_empty())
                        .collect()
                })
                .unwrap_or_default(),
            user_dir: user_plugin_dir(),
        }
    }
}

/// `$XDG_DATA_HOME/dspec/plugins`, else `~/.local/share/dspec/plugins`.
pub fn user_plugin_dir() -> Option<PathBuf> {
    xdg_dir("XDG_DATA_HOME", ".local/share").map(|data| data.join("dspec/plugins"))
}

fn is_library(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e == "so" || e == "dylib")
}

/// Shared libraries in `dir`, sorted by name so the order never depends on the file
/// system. A directory that does not exist is skipped, as `PATH` entries are.
fn libraries_in(dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let listing = std::fs::read_dir(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut found: Vec<PathBuf> = listing
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| is_library(p))
        .collect();
    found.sort();
    Ok(found)
}

/// Every plugin file to load, in search order, each once.
pub fn plugin_files(
    options: &PluginOptions,
    search: &PluginSearch,
) -> Result<Vec<PathBuf>, EngineError> {
    let mut files = Vec::new();
    for file in &options.files {
        if !file.is_file() {
            return Err(EngineError::Invalid(format!(
                "--plugin {}: no such file (give the path of a plugin's shared library)",
                file.display()
            )));
        }
        files.push(file.clone());
    }
    for dir in search.path_dirs.iter().chain(search.user_dir.iter()) {
        files.extend(libraries_in(dir)?);
    }
    // The same library reached twice (a --plugin that is also in a plugin dir) loads once.
    let mut seen = HashSet::new();
    files.retain(|f| seen.insert(f.canonicalize().unwrap_or_else(|_| f.clone())));
    Ok(files)
}

/// The registry with the built-ins and every plugin found, plus notes for the user
/// (plugins skipped because an earlier one of the same name was loaded).
pub struct PluginRegistry {
    pub registry: AdapterRegistry,
    pub plugins: Vec<Arc<PluginLibrary>>,
    pub notes: Vec<String>,
}

/// Built-in adapters plus the plugins `options` and `search` name.
pub fn registry_with_plugins(
    options: &PluginOptions,
    search: &PluginSearch,
) -> Result<PluginRegistry, EngineError> {
    let mut registry = builtin_registry()?;
    let mut plugins: Vec<Arc<PluginLibrary>> = Vec::new();
    let mut notes = Vec::new();
    for file in plugin_files(options, search)? {
        let plugin = load_plugin(&file)?;
        // An earlier copy of the same plugin wins: `--plugin` can point at a fresh
        // build of a plugin that is also installed.
        if let Some(first) = plugins.iter().find(|p| p.name() == plugin.name()) {
            notes.push(format!(
                "plugin {} ({}) skipped: already loaded from {}",
                plugin.name(),
                file.display(),
                first.path().display()
            ));
            continue;
        }
        add_plugin(&mut registry, &plugin, options.override_builtin)?;
        plugins.push(plugin);
    }
    Ok(PluginRegistry {
        registry,
        plugins,
        notes,
    })
}

/// Adds `plugin`'s family. A model_type a built-in owns is an error unless
/// `override_builtin`; one another plugin owns is always an error.
pub fn add_plugin(
    registry: &mut AdapterRegistry,
    plugin: &Arc<PluginLibrary>,
    override_builtin: bool,
) -> Result<(), EngineError> {
    for key in plugin.model_types() {
        let Some(owner) = registry
            .entries()
            .iter()
            .find(|e| e.model_types.contains(key))
        else {
            continue;
        };
        let message = match &owner.source {
            AdapterSource::Plugin { path, .. } => format!(
                "claims model_type `{key}`, which plugin {} ({}) already loads; remove one of the two",
                owner.name,
                path.display()
            ),
            AdapterSource::BuiltIn if !override_builtin => format!(
                "claims model_type `{key}`, which the built-in adapter {} already loads; pass --plugin-override to load `{key}` models with the plugin, or remove the plugin",
                owner.name
            ),
            AdapterSource::BuiltIn => continue,
        };
        return Err(ModelError::Plugin {
            path: plugin.path().to_path_buf(),
            message,
        }
        .into());
    }
    registry.add(plugin.adapter_entry(), override_builtin)?;
    Ok(())
}
