//! `ringllm bench`: picks the measurement its flags ask for; the measurements themselves are
//! in `crate::bench`.

use crate::bench;
use crate::cli::BenchArgs;
use anyhow::{bail, Result};
use std::process::ExitCode;

pub fn bench(args: BenchArgs) -> Result<ExitCode> {
    if args.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    if let Some(cluster) = &args.cluster {
        return bench::model::bench_cluster(&args, cluster);
    }
    if args.transports {
        return bench::transports::bench_transports(&args);
    }
    if args.activations {
        return bench::activations::bench_activations(&args);
    }
    if let Some(url) = &args.serve {
        return bench::serve::bench_serve(&args, url);
    }
    bench::model::bench_model(&args)
}
