//! Adapter plugins: model families shipped as shared libraries and loaded at run time.
//! [`abi`] is the C contract, [`export`] the plugin side of it, [`host`] dspec's side.

pub mod abi;
pub mod export;
pub mod host;

pub use host::{load_plugin, PluginLibrary};
