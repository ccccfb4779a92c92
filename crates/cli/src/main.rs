//! The `stowage` command. See the crate docs of `stowage_cli`.

#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    stowage_cli::cli::main_with_args(std::env::args_os())
}
