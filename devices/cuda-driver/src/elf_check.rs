//! A look at a configured library's ELF headers before dlopen sees it.
//!
//! FERRY_CUDA_LIBRARY can point anywhere; dlopen of a truncated file whose
//! segments run past its end raises SIGBUS in the host process. Reading the
//! file header and program headers (nothing else) is enough to refuse such a
//! file with a reason. The system's libcuda.so.1, found by the dynamic
//! loader's own search, is not checked.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

const ET_DYN: u16 = 3;
const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;

#[cfg(target_arch = "x86_64")]
const HOST_MACHINE: u16 = 62; // EM_X86_64
#[cfg(target_arch = "aarch64")]
const HOST_MACHINE: u16 = 183; // EM_AARCH64
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const HOST_MACHINE: u16 = 0;

fn u16_at(b: &[u8], at: usize) -> u16 {
    b.get(at..at + 2)
        .map_or(0, |s| u16::from_le_bytes([s[0], s[1]]))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |s| {
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        u64::from_le_bytes(a)
    })
}

/// `Ok` when `path` looks like a complete 64-bit little-endian shared
/// object for this machine; otherwise the reason.
pub fn check_shared_object(path: &Path) -> Result<(), String> {
    let mut file = File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot stat it: {e}"))?
        .len();
    let mut header = [0u8; 64];
    let mut got = 0;
    while got < header.len() {
        match file.read(&mut header[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("cannot read it: {e}")),
        }
    }
    if got < 4 || header[..4] != *b"\x7fELF" {
        return Err("not an ELF file".into());
    }
    if got < 64 {
        return Err(format!("truncated ELF: {len} bytes"));
    }
    if header[4] != 2 || header[5] != 1 {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    if u16_at(&header, 16) != ET_DYN {
        return Err("not a shared object".into());
    }
    let machine = u16_at(&header, 18);
    if machine != HOST_MACHINE {
        return Err(format!("built for ELF machine {machine}, not this host's"));
    }
    let phoff = u64_at(&header, 32);
    let phentsize = u64::from(u16_at(&header, 54));
    let phnum = u64::from(u16_at(&header, 56));
    if phentsize < 56 {
        return Err("corrupt program header table".into());
    }
    let table_len = phentsize * phnum;
    if phoff.checked_add(table_len).is_none_or(|end| end > len) {
        return Err(format!(
            "truncated ELF: its program headers end past the {len} bytes the file has"
        ));
    }
    let mut table = vec![0u8; table_len as usize];
    file.seek(SeekFrom::Start(phoff))
        .and_then(|_| file.read_exact(&mut table))
        .map_err(|e| format!("cannot read its program headers: {e}"))?;
    let mut has_dynamic = false;
    for entry in table.chunks_exact(phentsize as usize) {
        let p_type = u32_at(entry, 0);
        if p_type == PT_DYNAMIC {
            has_dynamic = true;
        }
        if p_type == PT_LOAD || p_type == PT_DYNAMIC {
            let end = u64_at(entry, 8).checked_add(u64_at(entry, 32));
            if end.is_none_or(|end| end > len) {
                return Err(format!(
                    "truncated ELF: a segment ends past the {len} bytes the file has"
                ));
            }
        }
    }
    if !has_dynamic {
        return Err("an ELF file without a dynamic section".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_text_and_truncated_files() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("text.so");
        std::fs::write(&text, "hello, I am not a library\n").unwrap();
        assert_eq!(check_shared_object(&text), Err("not an ELF file".into()));

        // The running test binary is a PIE (ET_DYN) for this machine, so a
        // whole copy passes and a truncated copy is refused.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let whole = dir.path().join("whole.so");
        std::fs::write(&whole, &me).unwrap();
        assert_eq!(check_shared_object(&whole), Ok(()));
        let cut = dir.path().join("cut.so");
        // Headers and program headers fit in 2000 bytes; the first loaded
        // segment does not.
        std::fs::write(&cut, &me[..2000]).unwrap();
        let why = check_shared_object(&cut).unwrap_err();
        assert!(why.starts_with("truncated ELF"), "{why}");
    }
}
