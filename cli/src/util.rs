//! Small helpers shared by the subcommands.

/// Parses sizes such as `4096`, `64K`, `1M`, `1G`, `16MiB` (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a size (like 4096, 64K, 1M, 1G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use K, M or G)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `4096` -> "4 KiB", `16777216` -> "16 MiB".
pub fn human_size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{} {unit}", n >> shift);
        }
    }
    format!("{n} B")
}

/// Fills `buf` with a reproducible pseudo-random pattern (xorshift64*).
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        c.copy_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    for b in chunks.into_remainder() {
        *b = x as u8;
    }
}

pub fn crc32(buf: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(buf);
    h.finalize()
}

/// A page-aligned, zeroed heap buffer (pages touched so their NUMA node is
/// known and the first transfer does not pay for page faults).
pub struct Buffer {
    ptr: *mut u8,
    len: usize,
}

impl Buffer {
    pub fn new(len: usize) -> Result<Buffer, String> {
        let len = len.max(1);
        // SAFETY: an anonymous private mapping; checked for MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!(
                "cannot allocate {}: {}",
                human_size(len as u64),
                std::io::Error::last_os_error()
            ));
        }
        let mut b = Buffer {
            ptr: ptr.cast(),
            len,
        };
        b.as_mut_slice().fill(0);
        Ok(b)
    }

    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live mapping of len bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is a live mapping of len bytes owned by self, and &mut self
        // gives exclusive access from Rust.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping we created, once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// SAFETY: Buffer owns its mapping; sharing it between threads is like
// sharing a Vec<u8> (the engine writes through raw addresses while Rust code
// does not touch the slice, which the callers arrange).
unsafe impl Send for Buffer {}
// SAFETY: &Buffer hands out only shared slices of memory it owns; writes
// come through the engine's raw addresses while the callers leave the
// slice alone, as for Send.
unsafe impl Sync for Buffer {}

/// The p-th percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("16MiB").unwrap(), 16 << 20);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999G").is_err());
        assert_eq!(human_size(65536), "64 KiB");
        assert_eq!(human_size(1000), "1000 B");
    }
}
