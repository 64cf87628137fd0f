//! Results on stdout. A reader that goes away (`ringllm info M --tensors | head -1`) ends the
//! process quietly with status 0, as `cat` does, where `println!` would panic on the closed
//! pipe. Use [`outln!`] and [`out!`] for every result line.

use std::io::{ErrorKind, Write};

/// Writes `args` (and a newline) to stdout, and flushes; see the module.
pub fn write(args: std::fmt::Arguments<'_>, newline: bool) {
    let mut o = std::io::stdout().lock();
    let r = o
        .write_fmt(args)
        .and_then(|()| if newline { o.write_all(b"\n") } else { Ok(()) })
        .and_then(|()| o.flush());
    if let Err(e) = r {
        gone(&e);
    }
}

/// Writes `text` to stdout at once; `false` when the reader went away (the caller stops what
/// it was producing). Other write errors end the process with a message.
pub fn stream(text: &str) -> bool {
    let mut o = std::io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|()| o.flush()) {
        Ok(()) => true,
        Err(e) if e.kind() == ErrorKind::BrokenPipe => false,
        Err(e) => gone(&e),
    }
}

/// Ends the process after a failed write to stdout: quietly for a closed pipe.
fn gone(e: &std::io::Error) -> ! {
    if e.kind() == ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: writing to stdout: {e}");
    std::process::exit(1);
}
