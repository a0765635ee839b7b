//! The `dspec` binary: parses the command line, runs the subcommand (one module each in
//! `cli/`), and turns the outcome into an exit code.

mod cli;

use clap::Parser;

use dspec_engine::runtime::{exit_process, version_report};

fn main() {
    // Before anything else: it may start the program again.
    dspec_engine::cpu_blas::restart_on_the_cpu_s_kernels();
    let cli = cli::Cli::parse();
    let result = match (cli.version, cli.command) {
        (true, _) => {
            println!("{}", version_report());
            Ok(())
        }
        (false, Some(command)) => command.run(&cli.plugins),
        (false, None) => {
            eprintln!(
                "dspec: give a command ({}) or --help",
                cli::command_names().join(", ")
            );
            std::process::exit(2);
        }
    };
    let code = match result {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("error: {err:#}");
            1
        }
    };
    // A command stopped by Ctrl-C said what it did; the status says it was stopped.
    let code = match cli::interrupt::interrupted() {
        true => cli::interrupt::EXIT_INTERRUPTED,
        false => code,
    };
    exit_process(code);
}
