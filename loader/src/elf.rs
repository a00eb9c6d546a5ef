//! Checks a plugin file before the dynamic loader sees it.
//!
//! dlopen maps a file's segments and touches them while relocating; a
//! truncated file whose segment runs past the end of the file raises SIGBUS
//! and kills the host process. So before dlopen we read the ELF headers (and
//! only the headers) and refuse, with a reason, anything that is not a
//! complete shared object for this machine, or that lacks an entry symbol.

use crate::fingerprint::FileStamp;
use object::elf;
use object::read::elf::{ElfFile64, FileHeader, ProgramHeader, Sym};
use object::{Endianness, ReadCache};
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// What the ELF headers say about a plugin file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ElfFacts {
    /// Defined dynamic symbols named `ferry_<kind>_plugin_v<N>`.
    pub entry_symbols: Vec<String>,
    /// The GNU build id (`.note.gnu.build-id`) in hex, when the linker wrote one.
    pub build_id: Option<String>,
    /// The file as it was read: size, mtime, device and inode.
    pub stamp: FileStamp,
}

#[cfg(target_arch = "x86_64")]
const HOST_MACHINE: (elf::Machine, &str) = (elf::EM_X86_64, "x86-64");
#[cfg(target_arch = "aarch64")]
const HOST_MACHINE: (elf::Machine, &str) = (elf::EM_AARCH64, "aarch64");
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const HOST_MACHINE: (elf::Machine, &str) = (elf::EM_NONE, "this architecture");

fn machine_name(machine: elf::Machine) -> String {
    match machine {
        elf::EM_X86_64 => "x86-64".into(),
        elf::EM_AARCH64 => "aarch64".into(),
        elf::EM_386 => "i386".into(),
        elf::EM_ARM => "32-bit ARM".into(),
        elf::EM_PPC64 => "ppc64".into(),
        elf::EM_RISCV => "RISC-V".into(),
        other => format!("machine {}", other.0),
    }
}

/// Inspects `path`; `Err` carries the reason in operator words.
pub fn inspect(path: &Path) -> Result<ElfFacts, String> {
    let mut file = File::open(path).map_err(|e| format!("cannot open the file: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat the file: {e}"))?;
    let len = meta.len();
    let stamp = FileStamp::of(&meta);
    let mut ident = [0u8; 16];
    let got = read_up_to(&mut file, &mut ident).map_err(|e| format!("cannot read: {e}"))?;
    if got < 4 || ident[..4] != *b"\x7fELF" {
        return Err(format!(
            "not an ELF shared object (the file starts with {})",
            describe_start(&ident[..got])
        ));
    }
    if got < 16 || len < 64 {
        return Err(format!(
            "truncated ELF: the file has {len} bytes, fewer than an ELF header needs"
        ));
    }
    // e_ident[4] is the class (2 = 64-bit), e_ident[5] the byte order (1 = LSB).
    if ident[4] != 2 {
        return Err("a 32-bit ELF file; Ferry loads 64-bit plugins only".into());
    }
    if ident[5] != 1 {
        return Err("a big-endian ELF file; this host is little-endian".into());
    }

    let cache = ReadCache::new(file);
    let header = elf::FileHeader64::<Endianness>::parse(&cache)
        .map_err(|e| format!("truncated or corrupt ELF header ({e})"))?;
    let endian = header
        .endian()
        .map_err(|e| format!("corrupt ELF header ({e})"))?;
    let e_type = header.e_type(endian);
    if e_type != elf::ET_DYN {
        return Err(format!(
            "an ELF {} rather than a shared object; build it with -shared -fPIC",
            match e_type {
                elf::ET_EXEC => "executable",
                elf::ET_REL => "object file (.o)",
                elf::ET_CORE => "core dump",
                _ => "file of unknown type",
            }
        ));
    }
    let machine = header.e_machine(endian);
    if machine != HOST_MACHINE.0 {
        return Err(format!(
            "built for {}, but this host is {}",
            machine_name(machine),
            HOST_MACHINE.1
        ));
    }
    let sections_end = u64::from(header.e_shnum(endian))
        .checked_mul(u64::from(header.e_shentsize(endian)))
        .and_then(|size| size.checked_add(header.e_shoff(endian)));
    if sections_end.is_none_or(|end| end > len) {
        return Err(format!(
            "truncated ELF: its section headers end past the {len} bytes the file has \
             (an incomplete copy or download?)"
        ));
    }

    let parsed = ElfFile64::<Endianness, _>::parse(&cache)
        .map_err(|e| format!("truncated or corrupt ELF ({e})"))?;
    let mut has_dynamic = false;
    let mut build_id = None;
    for ph in parsed.elf_program_headers() {
        let p_type = ph.p_type(endian);
        if p_type == elf::PT_DYNAMIC {
            has_dynamic = true;
        }
        if p_type == elf::PT_LOAD || p_type == elf::PT_DYNAMIC {
            let end = ph.p_offset(endian).checked_add(ph.p_filesz(endian));
            match end {
                Some(end) if end <= len => {}
                _ => {
                    return Err(format!(
                        "truncated ELF: a segment ends at byte {}, past the end of the \
                         {len}-byte file (an incomplete copy or download?)",
                        end.map_or_else(|| "overflow".to_string(), |e| e.to_string())
                    ))
                }
            }
        }
        if build_id.is_none() {
            build_id = gnu_build_id(ph, endian, &cache);
        }
    }
    if !has_dynamic {
        return Err("a static ELF without a dynamic section; it cannot be dlopen()ed".into());
    }

    let dynsym = parsed.elf_dynamic_symbol_table();
    if dynsym.is_empty() {
        return Err("exports no dynamic symbols (stripped of .dynsym?)".into());
    }
    let mut entry_symbols = Vec::new();
    for sym in dynsym.iter() {
        if sym.st_shndx(endian) == elf::SHN_UNDEF {
            continue;
        }
        let Ok(name) = dynsym.symbol_name(endian, sym) else {
            continue;
        };
        if let Ok(name) = std::str::from_utf8(name) {
            if is_entry_symbol(name) {
                entry_symbols.push(name.to_string());
            }
        }
    }
    entry_symbols.sort();
    Ok(ElfFacts {
        entry_symbols,
        build_id,
        stamp,
    })
}

/// The GNU build id in a PT_NOTE segment, in hex; `None` for anything else
/// (a malformed note is no reason to refuse a plugin, only to key it by
/// size and time alone).
fn gnu_build_id<'a, R: object::ReadRef<'a>>(
    ph: &elf::ProgramHeader64<Endianness>,
    endian: Endianness,
    data: R,
) -> Option<String> {
    let mut notes = ph.notes(endian, data).ok()??;
    while let Ok(Some(note)) = notes.next() {
        if note.name() == b"GNU" && note.n_type(endian) == elf::NT_GNU_BUILD_ID {
            let desc = note.desc();
            if desc.is_empty() || desc.len() > 64 {
                return None;
            }
            return Some(desc.iter().map(|b| format!("{b:02x}")).collect());
        }
    }
    None
}

/// `ferry_transport_plugin_v1`, `ferry_device_plugin_v12`, ...
pub fn is_entry_symbol(name: &str) -> bool {
    parse_entry_symbol(name).is_some()
}

/// Splits an entry symbol into (kind, major).
pub fn parse_entry_symbol(name: &str) -> Option<(&str, u32)> {
    let rest = name.strip_prefix("ferry_")?;
    let (kind, version) = rest.split_once("_plugin_v")?;
    if kind.is_empty() || version.is_empty() || !version.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((kind, version.parse().ok()?))
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut total = 0;
    while total < buf.len() {
        match file.read(&mut buf[total..])? {
            0 => break,
            n => total += n,
        }
    }
    Ok(total)
}

fn describe_start(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "nothing: it is empty".into();
    }
    if bytes.starts_with(b"!<arch>") {
        return "\"!<arch>\": a static archive (.a), not a shared object".into();
    }
    let shown = &bytes[..bytes.len().min(8)];
    if shown.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        format!("{:?}", String::from_utf8_lossy(shown))
    } else {
        shown
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_symbol_names() {
        assert_eq!(
            parse_entry_symbol("ferry_transport_plugin_v1"),
            Some(("transport", 1))
        );
        assert_eq!(
            parse_entry_symbol("ferry_device_plugin_v12"),
            Some(("device", 12))
        );
        assert_eq!(parse_entry_symbol("ferry_transport_plugin_v"), None);
        assert_eq!(parse_entry_symbol("ferry_transport_plugin_vx"), None);
        assert_eq!(parse_entry_symbol("ferry_plugin_v1"), None);
    }

    #[test]
    fn text_files_and_empty_files_are_refused_with_what_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("a.so");
        std::fs::write(&text, "hello world\n").unwrap();
        let err = inspect(&text).unwrap_err();
        assert!(
            err.contains("not an ELF") && err.contains("hello wo"),
            "{err}"
        );
        let empty = dir.path().join("b.so");
        std::fs::write(&empty, "").unwrap();
        assert!(inspect(&empty).unwrap_err().contains("empty"));
    }

    #[test]
    fn a_real_shared_object_passes_and_a_cut_one_does_not() {
        // The C library is a shared object present on every host we run on.
        let libc_path = [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib/aarch64-linux-gnu/libc.so.6",
        ]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists());
        let Some(libc_path) = libc_path else { return };
        let facts = inspect(libc_path).unwrap();
        assert!(facts.entry_symbols.is_empty());
        // Debian's and every other distribution's libc carries a build id.
        assert!(
            facts.build_id.as_ref().is_some_and(|id| id.len() >= 16),
            "{facts:?}"
        );
        let bytes = std::fs::read(libc_path).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cut = dir.path().join("cut.so");
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let err = inspect(&cut).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
    }
}
