//! The `dspec` command line: one module per subcommand, each with its arguments and its
//! `run`; `args` holds the argument groups several subcommands share.
//!
//! A subcommand is its own file here, plus its module, its variant of [`Command`] and
//! its arm of [`Command::run`] below.

mod adapters;
mod args;
mod bench;
mod convert;
mod generate;
pub mod interrupt;
mod score;
mod serve;
mod train_drafter;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};

use args::PluginArgs;

#[derive(Parser)]
#[command(
    name = "dspec",
    about = "Speculative decoding for LLMs on MLX",
    disable_version_flag = true
)]
pub struct Cli {
    /// Print dspec's version, the MLX version and the default device.
    #[arg(short = 'V', long = "version")]
    pub version: bool,
    #[command(flatten)]
    pub plugins: PluginArgs,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand)]
pub enum Command {
    /// Generate text from a prompt.
    Generate(generate::GenerateArgs),
    /// Plain greedy vs speculative decoding on the same prompts, in one process.
    ///
    /// With --temperature > 0, bench also times plain sampled decoding with the sampling
    /// flags given, in the same passes as plain greedy, and reports its tok/s and its
    /// ratio to greedy: what the sampler costs. The speculative runs stay greedy, so that
    /// their output can be checked against plain decoding's.
    Bench(bench::BenchArgs),
    /// How likely is a text: log-probability of a completion, rolling log-probabilities,
    /// or the next-token distribution; optionally with a LoRA adapter (--lora, --compare).
    Score(score::ScoreArgs),
    /// List the model families dspec can load, or explain which one a model dir uses.
    Adapters(adapters::AdaptersArgs),
    /// Convert a GGUF model file into a model directory `dspec generate` loads.
    Convert(convert::ConvertArgs),
    /// Serve a target and its drafter over an OpenAI-compatible HTTP API (chat and text
    /// completions, streamed or not), speculative decoding on for every request.
    Serve(serve::ServeArgs),
    /// Train a DFlash or DSpark drafter for a target on the target's own answers to your prompts
    /// (or on your text), on any MLX backend; the result loads with --drafter DIR.
    TrainDrafter(train_drafter::TrainDrafterArgs),
}

impl Command {
    /// Runs the subcommand; plugins are loaded by those that load models.
    pub fn run(self, plugins: &PluginArgs) -> Result<()> {
        match self {
            Command::Generate(args) => generate::run(args, plugins),
            Command::Bench(args) => bench::run(args, plugins),
            Command::Score(args) => score::run(args, plugins),
            Command::Adapters(args) => adapters::run(args, plugins),
            Command::Convert(args) => convert::run(args),
            Command::Serve(args) => serve::run(args, plugins),
            Command::TrainDrafter(args) => train_drafter::run(args, plugins),
        }
    }
}

/// The subcommands' names, in `--help`'s order.
pub fn command_names() -> Vec<String> {
    Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        // clap's own consistency checks (conflicting names, bad defaults, ...), which
        // otherwise only fire when a user reaches the broken flag.
        Cli::command().debug_assert();
    }

    #[test]
    fn every_subcommand_is_listed() {
        assert_eq!(
            command_names(),
            [
                "generate",
                "bench",
                "score",
                "adapters",
                "convert",
                "serve",
                "train-drafter"
            ]
        );
    }
}
