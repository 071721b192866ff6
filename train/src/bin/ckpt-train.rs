//! `ckpt-train`: the reference workload (see the `ckpt_train` library).

use clap::Parser;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CKPT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = ckpt_train::TrainArgs::parse();
    match ckpt_train::run(args) {
        Ok(out) => {
            if let Some(d) = out.digest {
                println!("digest {d}");
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ckpt-train: {e}");
            if ckpt_train::failed_on_resume_data() {
                // Not this machine's fault: the supervisor marks the step unusable.
                std::process::ExitCode::from(ckpt_recovery::DATA_FAILURE_EXIT as u8)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}
