//! What a probe asked the host (settings through config_get, NICs through
//! topo_nics) and a digest of each answer. A cached result is reused only
//! while the host would answer every question the same way, so an engine
//! configured differently, or a host whose NICs changed, probes again.
//! Answers are kept as digests: a setting may be a secret.

use crate::fingerprint::Digest;
use crate::host::HostServices;
use crate::protocol::WireNic;
use ferry_plugins_abi::sdk::Nic;
use ferry_plugins_abi::ErrorCode;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// Questions kept per probe; a probe that asks more is not cached.
const MAX_QUESTIONS: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Asked {
    Config {
        key: String,
        answer: String,
    },
    Nics {
        location: Option<String>,
        answer: String,
    },
}

fn config_digest(value: Option<&str>) -> String {
    let mut d = Digest::new("config");
    match value {
        Some(v) => d.add("some").add(v),
        None => d.add("none"),
    };
    d.finish()
}

fn nics_digest(result: &Result<Vec<Nic>, ErrorCode>) -> String {
    let mut d = Digest::new("nics");
    match result {
        Ok(nics) => {
            let wire: Vec<WireNic> = nics.iter().map(WireNic::from).collect();
            d.add(&serde_json::to_string(&wire).unwrap_or_default())
        }
        Err(code) => d.add(&format!("error {}", code.as_raw())),
    };
    d.finish()
}

/// Records questions and answers as a probe asks them.
#[derive(Default)]
pub(crate) struct Recorder {
    asked: Mutex<(Vec<Asked>, bool)>,
}

impl Recorder {
    fn note(&self, q: Asked) {
        let mut g = self.asked.lock().unwrap_or_else(|e| e.into_inner());
        if g.0.contains(&q) {
            return;
        }
        if g.0.len() >= MAX_QUESTIONS {
            g.1 = true;
            return;
        }
        g.0.push(q);
    }

    /// Asks `host` for a setting on the probe's behalf.
    pub(crate) fn config(&self, host: &dyn HostServices, key: &str) -> Option<String> {
        let value = host.config(key);
        self.note(Asked::Config {
            key: key.to_string(),
            answer: config_digest(value.as_deref()),
        });
        value
    }

    /// Asks `host` for NICs on the probe's behalf.
    pub(crate) fn nics(
        &self,
        host: &dyn HostServices,
        location: Option<&str>,
    ) -> Result<Vec<Nic>, ErrorCode> {
        let result = host.nics(location);
        self.note(Asked::Nics {
            location: location.map(str::to_string),
            answer: nics_digest(&result),
        });
        result
    }

    /// Everything asked, plus the host's whole NIC list, asked or not (a NIC
    /// that appears or changes link state may change any probe's result);
    /// `None` when the probe asked too much to keep.
    pub(crate) fn finish(&self, host: &dyn HostServices) -> Option<Vec<Asked>> {
        let _ = self.nics(host, None);
        let g = self.asked.lock().unwrap_or_else(|e| e.into_inner());
        (!g.1).then(|| g.0.clone())
    }
}

/// Whether `host` answers every question as it did when they were asked.
pub(crate) fn still_true(asked: &[Asked], host: &dyn HostServices) -> bool {
    asked.iter().all(|q| match q {
        Asked::Config { key, answer } => config_digest(host.config(key).as_deref()) == *answer,
        Asked::Nics { location, answer } => nics_digest(&host.nics(location.as_deref())) == *answer,
    })
}

/// Host services that record what a probe in this process asks, until
/// `stop` (the same library then serves the engine, unrecorded).
pub(crate) struct RecordingHost {
    pub(crate) inner: Arc<dyn HostServices>,
    pub(crate) recorder: Recorder,
    pub(crate) recording: std::sync::atomic::AtomicBool,
}

impl RecordingHost {
    pub(crate) fn new(inner: Arc<dyn HostServices>) -> RecordingHost {
        RecordingHost {
            inner,
            recorder: Recorder::default(),
            recording: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// What was asked (see [`Recorder::finish`]); recording stops.
    pub(crate) fn stop(&self) -> Option<Vec<Asked>> {
        self.recording
            .store(false, std::sync::atomic::Ordering::Release);
        self.recorder.finish(&*self.inner)
    }

    fn on(&self) -> bool {
        self.recording.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl HostServices for RecordingHost {
    fn log(&self, plugin: &str, level: log::Level, msg: &str) {
        self.inner.log(plugin, level, msg)
    }

    fn log_enabled(&self, plugin: &str, level: log::Level) -> bool {
        self.inner.log_enabled(plugin, level)
    }

    fn config(&self, key: &str) -> Option<String> {
        if self.on() {
            self.recorder.config(&*self.inner, key)
        } else {
            self.inner.config(key)
        }
    }

    fn nics(&self, location: Option<&str>) -> Result<Vec<Nic>, ErrorCode> {
        if self.on() {
            self.recorder.nics(&*self.inner, location)
        } else {
            self.inner.nics(location)
        }
    }

    fn peer_request(
        &self,
        plugin: &str,
        peer: &str,
        body: &[u8],
    ) -> Result<Vec<u8>, (ErrorCode, String)> {
        self.inner.peer_request(plugin, peer, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(Option<&'static str>);
    impl HostServices for Fixed {
        fn config(&self, _: &str) -> Option<String> {
            self.0.map(str::to_string)
        }
        fn nics(&self, _: Option<&str>) -> Result<Vec<Nic>, ErrorCode> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn a_different_answer_invalidates_and_secrets_are_not_kept() {
        let r = Recorder::default();
        assert_eq!(
            r.config(&Fixed(Some("s3cret")), "auth.token").as_deref(),
            Some("s3cret")
        );
        let asked = r.finish(&Fixed(Some("s3cret"))).unwrap();
        assert_eq!(asked.len(), 2, "the setting and the NIC list: {asked:?}");
        assert!(!serde_json::to_string(&asked).unwrap().contains("s3cret"));
        assert!(still_true(&asked, &Fixed(Some("s3cret"))));
        assert!(!still_true(&asked, &Fixed(Some("other"))));
        assert!(!still_true(&asked, &Fixed(None)));
    }
}
