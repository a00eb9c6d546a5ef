//! `ferry bench tcp-limit`: this machine's own single-stream TCP loopback
//! limit, the figure tcp rows are compared with. One process writes blocks
//! into a loopback socket, another (`tcp-sink`) reads them, no engine in
//! between. With `--scatter`, both move blocks from and to shuffled places
//! of a buffer of that size, a writev/readv of up to 1,024 blocks a call,
//! as the tcp transport frames a block list: the kernel's own cost of
//! scattered blocks, for KV-shaped runs (`scripts/bench-kv.sh`).

use crate::bench_kv::sample;
use crate::util::{human_size, Buffer};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

/// Most iovecs one readv/writev takes (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// Blocks of `block` bytes at shuffled places of a buffer, walked in that
/// order round and round: a window of up to IOV_MAX iovecs that calls use
/// up from the front (as the tcp transport's frames do), refilled only
/// once it is used up.
struct Scattered {
    buf: Buffer,
    block: usize,
    order: Vec<u64>,
    /// The block of `order` the next refill starts with.
    next: usize,
    iov: Vec<libc::iovec>,
    /// The first iovec not yet used up (a partly moved one is trimmed).
    idx: usize,
}

impl Scattered {
    fn new(bytes: u64, block: usize, seed: u64) -> Result<Scattered, String> {
        let count = bytes / block as u64;
        if block == 0 || count == 0 {
            return Err(format!(
                "--scatter {} holds no block of {}",
                human_size(bytes),
                human_size(block as u64)
            ));
        }
        Ok(Scattered {
            buf: Buffer::new((count * block as u64) as usize)?,
            block,
            order: sample(count, count, seed),
            next: 0,
            iov: Vec::with_capacity(IOV_MAX),
            idx: 0,
        })
    }

    /// What is left of the window, refilled with the next blocks of the
    /// order when it is used up.
    fn window(&mut self) -> &[libc::iovec] {
        if self.idx == self.iov.len() {
            self.iov.clear();
            self.idx = 0;
            let base = self.buf.addr() as usize;
            for _ in 0..IOV_MAX.min(self.order.len()) {
                let at = base + self.order[self.next] as usize * self.block;
                self.iov.push(libc::iovec {
                    iov_base: at as *mut libc::c_void,
                    iov_len: self.block,
                });
                self.next = (self.next + 1) % self.order.len();
            }
        }
        &self.iov[self.idx..]
    }

    /// Uses up `n` bytes of the window's front.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let v = &mut self.iov[self.idx];
            if n >= v.iov_len {
                n -= v.iov_len;
                self.idx += 1;
            } else {
                v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
                v.iov_len -= n;
                n = 0;
            }
        }
    }
}

/// One readv or writev of `s`'s next window; bytes moved (0: EOF).
fn scattered_io(fd: i32, s: &mut Scattered, write: bool) -> Result<usize, String> {
    loop {
        let iov = s.window();
        // SAFETY: every iovec lies inside `s.buf`, which lives as long as
        // `s`, and `iov` is not touched until the call returns; the kernel
        // reads (writev) or writes (readv) only those ranges.
        let n = unsafe {
            if write {
                libc::writev(fd, iov.as_ptr(), iov.len() as i32)
            } else {
                libc::readv(fd, iov.as_ptr(), iov.len() as i32)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.to_string());
        }
        s.advance(n as usize);
        return Ok(n as usize);
    }
}

/// Writes `block`-sized blocks into a loopback socket for `duration`, to
/// a `tcp-sink` child process; `scatter`: the buffer both sides shuffle
/// their blocks over (None: one block written again and again).
pub fn tcp_limit(
    duration: f64,
    block: usize,
    scatter: Option<u64>,
    json: bool,
) -> Result<(), String> {
    if block == 0 {
        return Err("--block must be positive".into());
    }
    let mut source = scatter
        .map(|bytes| Scattered::new(bytes, block, 1))
        .transpose()?;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut args = vec![
        "bench".to_string(),
        "tcp-sink".into(),
        "--connect".into(),
        addr.to_string(),
    ];
    if let Some(bytes) = scatter {
        args.extend([
            "--block".into(),
            block.to_string(),
            "--scatter".into(),
            bytes.to_string(),
        ]);
    }
    let child = std::process::Command::new(exe)
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the receiving process: {e}"))?;
    let (mut stream, _) = listener.accept().map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let data = vec![0x5au8; block];
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < duration {
        match source.as_mut() {
            Some(s) => {
                scattered_io(stream.as_raw_fd(), s, true)?;
            }
            None => stream.write_all(&data).map_err(|e| e.to_string())?,
        }
    }
    drop(stream);
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut parts = text.split_whitespace();
    let bytes: f64 = parts
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or("no result from the sink")?;
    let secs: f64 = parts
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or("no result from the sink")?;
    let gbps = bytes / secs / 1e9;
    if json {
        println!(
            "{}",
            serde_json::json!({"limit": "tcp-single-stream", "gb_per_s": gbps, "bytes": bytes,
                "duration_s": secs, "block_size": block, "scatter_bytes": scatter})
        );
    } else {
        let shape = match scatter {
            Some(b) => format!(", shuffled over {}", human_size(b)),
            None => String::new(),
        };
        println!(
            "single-stream TCP loopback: {gbps:.3} GB/s ({} blocks{shape})",
            human_size(block as u64)
        );
    }
    Ok(())
}

/// The receiving side of `tcp-limit`: counts bytes until EOF, read into
/// one buffer, or into shuffled blocks of a `scatter`-byte one.
pub fn tcp_sink(connect: &str, block: usize, scatter: Option<u64>) -> Result<(), String> {
    // The buffer first: the writer's clock starts when we connect.
    let mut into = scatter
        .map(|bytes| Scattered::new(bytes, block, 2))
        .transpose()?;
    let mut stream = TcpStream::connect(connect).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total: u64 = 0;
    let mut first: Option<Instant> = None;
    loop {
        let n = match into.as_mut() {
            Some(s) => scattered_io(stream.as_raw_fd(), s, false)?,
            None => stream.read(&mut buf).map_err(|e| e.to_string())?,
        };
        if n == 0 {
            break;
        }
        first.get_or_insert_with(Instant::now);
        total += n as u64;
    }
    let secs = first.map(|f| f.elapsed().as_secs_f64()).unwrap_or(0.0);
    println!("{total} {secs}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scattered_cursor_walks_every_block_in_order_and_wraps() {
        let mut s = Scattered::new(4 * 4096, 4096, 3).unwrap();
        let base = s.buf.addr() as usize;
        let first: Vec<usize> = s
            .window()
            .iter()
            .map(|v| v.iov_base as usize - base)
            .collect();
        // Four blocks: a window of all four, each at its shuffled place.
        assert_eq!(first.len(), 4);
        let mut places = first.clone();
        places.sort_unstable();
        assert_eq!(places, vec![0, 4096, 8192, 12288]);
        // Part of a block: the next window starts inside it.
        s.advance(4096 + 100);
        let w = s.window();
        assert_eq!(w[0].iov_base as usize - base, first[1] + 100);
        assert_eq!(w[0].iov_len, 4096 - 100);
        // Past the end: round again from the first block.
        s.advance(3 * 4096 - 100);
        assert_eq!(s.window()[0].iov_base as usize - base, first[0]);
        assert!(Scattered::new(100, 4096, 1).is_err());
    }

    #[test]
    fn scattered_blocks_cross_a_socket_whole() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut into = Scattered::new(8 * 4096, 4096, 2).unwrap();
            let mut got = 0;
            while got < 8 * 4096 {
                got += scattered_io(stream.as_raw_fd(), &mut into, false).unwrap();
            }
            (into.order.clone(), into.buf.as_slice().to_vec())
        });
        let stream = TcpStream::connect(addr).unwrap();
        let mut from = Scattered::new(8 * 4096, 4096, 1).unwrap();
        for (i, b) in from.buf.as_mut_slice().chunks_mut(4096).enumerate() {
            b.fill(i as u8 + 1);
        }
        let mut sent = 0;
        while sent < 8 * 4096 {
            sent += scattered_io(stream.as_raw_fd(), &mut from, true).unwrap();
        }
        let (order, got) = reader.join().unwrap();
        // The k-th block sent lands in the k-th block of the reader's order.
        assert_ne!(order, from.order);
        for (&src, &dst) in from.order.iter().zip(&order) {
            let (src, dst) = (src as usize * 4096, dst as usize * 4096);
            assert_eq!(got[dst..dst + 4096], from.buf.as_slice()[src..src + 4096]);
        }
    }
}
