//! `dspec adapters`: the model families and drafter kinds this build (with its plugins)
//! can load, or which adapter a model directory resolves to and why.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use dspec_engine::loading::drafting::available_drafters;

use super::args::PluginArgs;

#[derive(Args)]
pub struct AdaptersArgs {
    /// Report which adapter this model directory resolves to, and why.
    #[arg(long)]
    detect: Option<PathBuf>,
}

pub fn run(args: AdaptersArgs, plugins: &PluginArgs) -> Result<()> {
    let registry = plugins.registry()?;
    if let Some(dir) = args.detect {
        let found = registry.detect(&dir)?;
        println!(
            "{}: adapter {} — {}",
            dir.display(),
            found.adapter.name,
            found.reason
        );
        return Ok(());
    }
    let rows: Vec<(String, String, String)> = registry
        .entries()
        .iter()
        .flat_map(|e| {
            let keys = e
                .model_types
                .iter()
                .cloned()
                .chain(e.aliases.iter().map(|a| format!("{a} (alias)")));
            keys.map(move |k| (k, e.name.clone(), e.source.to_string()))
        })
        .collect();
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(10).max(10);
    let name_width = rows.iter().map(|r| r.1.len()).max().unwrap_or(7).max(7);
    println!(
        "{:<width$}  {:<name_width$}  SOURCE",
        "MODEL_TYPE", "ADAPTER"
    );
    for (key, name, source) in rows {
        println!("{key:<width$}  {name:<name_width$}  {source}");
    }
    let drafters = available_drafters()?;
    let width = drafters.iter().map(|d| d.0.len()).max().unwrap_or(6).max(6);
    println!("\n{:<width$}  SUMMARY", "DRAFTER");
    for (kind, summary) in drafters {
        println!("{kind:<width$}  {summary}");
    }
    Ok(())
}
