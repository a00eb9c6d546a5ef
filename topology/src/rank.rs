//! Preferred NIC lists per memory location.
//!
//! Order, best first: usable NICs before NICs whose ports are down (a down
//! port is never first, however close), then path class, then RDMA before
//! plain network interfaces, then faster before slower, then name.
//!
//! Spreading: GPUs whose best NICs tie (same usability, class, kind and
//! speed) would otherwise all take the first of them. Walking GPUs in ordinal order, each takes the tied NIC that the
//! fewest earlier GPUs took first (ties to the earlier NIC), and the rest of
//! its tied NICs follow cyclically. For GPUs that share the same tied set this
//! is round-robin: GPU k of the group starts at tied NIC k mod n, as NCCL
//! spreads GPUs over equally close NICs. `cpu:N` rows are not spread (there is
//! one row per node). NICs of different speeds do not tie: a GPU sharing a
//! 400 Gb/s NIC is not sent to a 1 Gb/s management port on the same bridge.
//!
//! A topology file pin replaces the computed order for its location: pinned
//! NICs first, in the file's order, except that down NICs still go last.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use super::class::PathClass;
use super::model::{Nic, NicKind, RankedNic};

pub(crate) struct RankInput<'a> {
    /// `cpu:N` rows first, then the GPU rows.
    pub locations: &'a [String],
    /// How many of the last `locations` are GPUs.
    pub gpu_location_count: usize,
    pub nics: &'a [Nic],
    /// `classes[location][nic]`.
    pub classes: &'a [Vec<PathClass>],
    /// Pinned NIC indices by location index.
    pub pins: &'a BTreeMap<usize, Vec<usize>>,
    pub warnings: &'a mut Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct RankKey {
    unusable: bool,
    class: PathClass,
    kind: NicKind,
    speed: Reverse<u64>,
}

/// One preferred list per location, in `locations` order.
pub(crate) fn rank_locations(input: &mut RankInput<'_>) -> Vec<Vec<RankedNic>> {
    let nics = input.nics;
    let first_gpu = input
        .locations
        .len()
        .saturating_sub(input.gpu_location_count);
    let mut first_choices = vec![0usize; nics.len()];
    let mut lists = Vec::with_capacity(input.locations.len());
    for (location_index, location) in input.locations.iter().enumerate() {
        let Some(classes) = input.classes.get(location_index) else {
            lists.push(Vec::new());
            continue;
        };
        let key = |nic: usize| RankKey {
            unusable: !nics[nic].state.is_usable(),
            class: classes.get(nic).copied().unwrap_or(PathClass::Unknown),
            kind: nics[nic].kind,
            speed: Reverse(nics[nic].speed_mbps.unwrap_or(0)),
        };
        // Stable sort: NIC order (RDMA first, natural name order) breaks ties.
        let mut order: Vec<usize> = (0..nics.len()).collect();
        order.sort_by_key(|&nic| key(nic));
        let is_gpu = location_index >= first_gpu;
        let pinned = input.pins.get(&location_index);

        if let Some(pinned) = pinned {
            for &nic in pinned.iter().filter(|&&nic| !nics[nic].state.is_usable()) {
                input.warnings.push(format!(
                    "topology file pins {} for {location}, but its state is {}: it goes last",
                    nics[nic].name,
                    nics[nic].state.as_str()
                ));
            }
            let usable = |nic: &usize| nics[*nic].state.is_usable();
            let unpinned: Vec<usize> = order
                .iter()
                .copied()
                .filter(|nic| !pinned.contains(nic))
                .collect();
            order = pinned
                .iter()
                .copied()
                .filter(usable)
                .chain(unpinned.iter().copied().filter(usable))
                .chain(pinned.iter().copied().filter(|nic| !usable(nic)))
                .chain(unpinned.iter().copied().filter(|nic| !usable(nic)))
                .collect();
        } else if is_gpu && !order.is_empty() {
            let best = key(order[0]);
            let tied = order.iter().take_while(|&&nic| key(nic) == best).count();
            if tied > 1 {
                let start = (0..tied)
                    .min_by_key(|&position| (first_choices[order[position]], position))
                    .unwrap_or(0);
                order[..tied].rotate_left(start);
            }
        }
        if is_gpu {
            if let Some(&first) = order.first() {
                first_choices[first] += 1;
            }
        }
        lists.push(
            order
                .iter()
                .map(|&nic| RankedNic {
                    name: nics[nic].name.clone(),
                    class: classes.get(nic).copied().unwrap_or(PathClass::Unknown),
                    usable: nics[nic].state.is_usable(),
                    pinned: pinned.is_some_and(|pinned| pinned.contains(&nic)),
                })
                .collect(),
        );
    }
    lists
}
