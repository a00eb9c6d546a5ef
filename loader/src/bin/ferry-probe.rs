//! ferry-probe: loads and probes one plugin in a child process of the
//! application, so that a plugin that crashes or hangs ends this process
//! only. Started by Ferry's plugin loader (ferry_loader::isolate), which
//! finds it beside the plugins; not meant to be run by hand.

fn main() {
    std::process::exit(ferry_loader::probe_helper_main());
}
