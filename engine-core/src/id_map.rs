//! Maps keyed by the engine's own small numbers (batch, segment and
//! transport ids, flow keys), looked up several times per request: hashed
//! with FxHash (a multiply and a rotate per word) rather than SipHash, which
//! cost about a tenth of a 4 KiB request's time. Never for keys that come
//! from the network or a peer (SipHash's keyed hashing is what protects
//! those maps from chosen collisions): these keys are numbers the engine
//! handed out itself.

use std::collections::{HashMap, HashSet};

pub(crate) type IdMap<K, V> = HashMap<K, V, rustc_hash::FxBuildHasher>;
pub(crate) type IdSet<K> = HashSet<K, rustc_hash::FxBuildHasher>;
