//! Which NIC pairs carry a request: the rails.
//!
//! Each side ranks its NICs for the buffer's memory (the engine's topology:
//! closest first); the equally closest ones that can reach the other side
//! (a NIC there with the same link layer) are that side's rails: a GPU
//! host whose compute NICs are InfiniBand reaches a RoCE-only host through
//! its nearest RoCE NICs. A
//! request uses rail k = (local rail k mod L, remote rail k mod R) for k up
//! to max(L, R) (or `FERRY_RDMA_RAILS`), so both ends spread over all their
//! best NICs. Pairs must share a link layer (InfiniBand with InfiniBand,
//! RoCE with RoCE). When a pair fails, a slice moves to the next pair: the
//! other rails first, then the rest of both rankings.

/// (local NIC index, remote NIC index in the peer's endpoint).
pub type Pair = (usize, u8);

/// The leading tier of `ranked` among the NICs `keep` accepts: every kept
/// NIC of the first tier that has one. `tiers` gives each entry of
/// `ranked` its tier (equal for equally close NICs); without it (a key from
/// an older peer) the first `best` entries are one tier and each later one
/// its own, and `best` 0 makes them all one tier.
pub fn first_tier<T: Copy>(
    ranked: &[T],
    tiers: &[u8],
    best: usize,
    keep: impl Fn(T) -> bool,
) -> Vec<T> {
    let tier = |i: usize| -> usize {
        match tiers.get(i) {
            Some(t) if tiers.len() == ranked.len() => usize::from(*t),
            _ if best == 0 || i < best => 0,
            _ => i,
        }
    };
    let Some(first) = (0..ranked.len()).find(|&i| keep(ranked[i])) else {
        return Vec::new();
    };
    (first..ranked.len())
        .filter(|&i| tier(i) == tier(first) && keep(ranked[i]))
        .map(|i| ranked[i])
        .collect()
}

/// The rails of one request.
pub fn rails(
    local_best: &[usize],
    remote_best: &[u8],
    remote_all: &[u8],
    compatible: &dyn Fn(usize, u8) -> bool,
    max: usize,
) -> Vec<Pair> {
    let (nl, nr) = (local_best.len(), remote_best.len());
    if nl == 0 || remote_all.is_empty() {
        return Vec::new();
    }
    let mut n = nl.max(nr.max(1));
    if max > 0 {
        n = n.min(max);
    }
    let mut out: Vec<Pair> = Vec::with_capacity(n);
    for k in 0..nl.max(nr.max(1)) {
        if out.len() >= n {
            break;
        }
        let l = local_best[k % nl];
        // The remote rail of this position, else the next compatible one
        // among the rails, else any compatible remote NIC.
        let from_rails = (0..nr)
            .map(|i| remote_best[(k + i) % nr])
            .find(|r| compatible(l, *r) && !out.contains(&(l, *r)));
        let r = from_rails.or_else(|| {
            remote_all
                .iter()
                .copied()
                .find(|r| compatible(l, *r) && !out.contains(&(l, *r)))
        });
        if let Some(r) = r {
            out.push((l, r));
        }
    }
    out
}

/// Every usable pair in order of preference: the rails, then local NICs by
/// rank, each with remote NICs by rank.
pub fn candidates(
    rails: &[Pair],
    local_all: &[usize],
    remote_all: &[u8],
    compatible: &dyn Fn(usize, u8) -> bool,
) -> Vec<Pair> {
    let mut out: Vec<Pair> = rails.to_vec();
    for &l in local_all {
        for &r in remote_all {
            if compatible(l, r) && !out.contains(&(l, r)) {
                out.push((l, r));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(_: usize, _: u8) -> bool {
        true
    }

    #[test]
    fn both_ends_spread_over_their_best_nics() {
        // Four local rails, four remote rails: four pairs, in rank order.
        assert_eq!(
            rails(&[0, 3, 4, 5], &[0, 1, 2, 3], &[0, 1, 2, 3], &any, 0),
            vec![(0, 0), (3, 1), (4, 2), (5, 3)]
        );
        // One local rail (a GPU's PIX NIC), four remote ones: all four
        // remote NICs are used from the one local NIC.
        assert_eq!(
            rails(&[2], &[0, 1, 2, 3], &[0, 1, 2, 3], &any, 0),
            vec![(2, 0), (2, 1), (2, 2), (2, 3)]
        );
        // FERRY_RDMA_RAILS=1: the first-ranked NIC on both sides.
        assert_eq!(rails(&[6, 9], &[0, 3], &[0, 3], &any, 1), vec![(6, 0)]);
        assert_eq!(rails(&[], &[0], &[0], &any, 0), vec![]);
    }

    #[test]
    fn pairs_share_a_link_layer() {
        // Local 0 is InfiniBand, local 1 RoCE; remote 0 RoCE, remote 1 IB.
        let ib = |n: usize| n == 0;
        let rib = |r: u8| r == 1;
        let compatible = |l: usize, r: u8| ib(l) == rib(r);
        assert_eq!(
            rails(&[0, 1], &[0, 1], &[0, 1], &compatible, 0),
            vec![(0, 1), (1, 0)]
        );
        // No compatible remote rail: fall back to any remote NIC.
        assert_eq!(rails(&[0], &[0], &[0, 1], &compatible, 0), vec![(0, 1)]);
        assert_eq!(rails(&[0], &[0], &[0], &compatible, 0), vec![]);
    }

    #[test]
    fn the_first_tier_that_can_reach_the_peer() {
        // Tiers: 0,0 (IB, PIX), 1,1 (RoCE, NODE), 2 (RoCE, SYS).
        let ranked = [0usize, 3, 1, 2, 7];
        let tiers = [0u8, 0, 1, 1, 2];
        let roce = |n: usize| matches!(n, 1 | 2 | 7);
        assert_eq!(first_tier(&ranked, &tiers, 2, |_| true), vec![0, 3]);
        assert_eq!(first_tier(&ranked, &tiers, 2, roce), vec![1, 2]);
        assert_eq!(first_tier(&ranked, &tiers, 2, |n| n == 7), vec![7]);
        assert_eq!(
            first_tier(&ranked, &tiers, 2, |_| false),
            Vec::<usize>::new()
        );
        // Without tiers: the first `best`, else the first kept one.
        assert_eq!(first_tier(&ranked, &[], 2, |_| true), vec![0, 3]);
        assert_eq!(first_tier(&ranked, &[], 2, roce), vec![1]);
        assert_eq!(first_tier(&ranked, &[], 0, roce), vec![1, 2, 7]);
    }

    #[test]
    fn candidates_start_with_the_rails() {
        let c = candidates(&[(0, 0), (3, 1)], &[0, 3, 6], &[0, 1], &any);
        assert_eq!(c, vec![(0, 0), (3, 1), (0, 1), (3, 0), (6, 0), (6, 1)]);
    }
}
