//! A charm directory as files: what is shipped of it ([`charm_manifest`]:
//! links inside the charm as copies, nothing outside it, at most
//! [`MAX_CHARM_BYTES`]), and the archive a client uploads a charm in
//! ([`write_archive`], read back by [`Unpacker`] as it arrives, a file at a
//! time, never the whole charm in memory).
//!
//! The archive: `JCH1`, then per file its path's length (u16, big-endian),
//! the path (UTF-8, relative, `/`-separated), its mode (u32) and length
//! (u64) and its bytes; a path length of 0 ends it.

use crate::api::{ApiError, ApiResult, ErrorCode, MAX_CHARM_BYTES};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One file of a charm as [`charm_manifest`] finds it.
#[derive(Debug, Clone)]
pub struct CharmEntry {
    /// Relative to the charm's root, `/`-separated.
    pub path: String,
    pub file: std::path::PathBuf,
    pub mode: u32,
    pub len: u64,
}

/// The files of the charm at `root`, sorted by path, without reading them:
/// at most [`MAX_CHARM_BYTES`] in all. A symlink to a file inside the charm
/// (charmcraft links `hooks/install` to `../dispatch`) is shipped as a copy
/// of that file; one that leaves the charm, or names a directory, is
/// refused.
pub fn charm_manifest(root: &Path) -> ApiResult<Vec<CharmEntry>> {
    use std::os::unix::fs::PermissionsExt;
    let internal = |what: String| ApiError::new(ErrorCode::Internal, what);
    let real_root = std::fs::canonicalize(root).map_err(|e| {
        internal(format!(
            "cannot read the charm at `{}`: {e}",
            root.display()
        ))
    })?;
    let mut out = Vec::new();
    let mut total = 0u64;
    let mut todo = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel)) = todo.pop() {
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| internal(format!("cannot read the charm at `{}`: {e}", dir.display())))?;
        for entry in entries {
            let entry = entry.map_err(|e| internal(e.to_string()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let mut meta =
                std::fs::symlink_metadata(entry.path()).map_err(|e| internal(e.to_string()))?;
            if meta.file_type().is_symlink() {
                let target = std::fs::canonicalize(entry.path())
                    .ok()
                    .filter(|t| t.starts_with(&real_root))
                    .and_then(|t| std::fs::metadata(t).ok())
                    .filter(|m| m.is_file());
                match target {
                    Some(m) => meta = m,
                    None => {
                        return Err(ApiError::new(
                            ErrorCode::Refused,
                            format!("the charm at `{}` holds `{path}`, a symlink that does not name a file inside the charm; make it a link to a file in the charm, or a copy", root.display()),
                        ))
                    }
                }
            }
            if meta.is_dir() {
                todo.push((entry.path(), path));
            } else if meta.is_file() {
                total += meta.len();
                if total > MAX_CHARM_BYTES as u64 {
                    return Err(ApiError::new(
                        ErrorCode::Refused,
                        format!("the charm at `{}` is larger than {} MiB; agents on other machines cannot fetch it", root.display(), MAX_CHARM_BYTES >> 20),
                    ));
                }
                out.push(CharmEntry {
                    path,
                    file: entry.path(),
                    mode: meta.permissions().mode() & 0o7777,
                    len: meta.len(),
                });
            } else {
                return Err(ApiError::new(
                    ErrorCode::Refused,
                    format!("the charm at `{}` holds `{path}`, which is not a plain file, directory or link to a file in the charm", root.display()),
                ));
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

const MAGIC: &[u8; 4] = b"JCH1";
/// The most files an archive may hold.
pub const MAX_CHARM_FILES: usize = 10_000;
/// The longest path in an archive.
const MAX_PATH: usize = 1024;

/// Writes the charm at `root` as an archive to `out`, a file at a time.
pub fn write_archive(root: &Path, out: &mut impl Write) -> ApiResult<()> {
    let io = |e: std::io::Error| ApiError::new(ErrorCode::Internal, e.to_string());
    let entries = charm_manifest(root)?;
    if entries.len() > MAX_CHARM_FILES {
        return Err(ApiError::new(
            ErrorCode::Refused,
            format!(
                "the charm at `{}` holds more than {MAX_CHARM_FILES} files",
                root.display()
            ),
        ));
    }
    out.write_all(MAGIC).map_err(io)?;
    for e in entries {
        let data = std::fs::read(&e.file).map_err(io)?;
        out.write_all(&(e.path.len() as u16).to_be_bytes())
            .map_err(io)?;
        out.write_all(e.path.as_bytes()).map_err(io)?;
        out.write_all(&e.mode.to_be_bytes()).map_err(io)?;
        out.write_all(&(data.len() as u64).to_be_bytes())
            .map_err(io)?;
        out.write_all(&data).map_err(io)?;
    }
    out.write_all(&0u16.to_be_bytes()).map_err(io)?;
    Ok(())
}

/// Lays out an archive under `dir` as its bytes arrive ([`Unpacker::feed`]),
/// holding at most one header and one chunk: refused (with what it wrote
/// left for the caller to remove) past [`MAX_CHARM_BYTES`] or
/// [`MAX_CHARM_FILES`], or on a path that is absolute, climbs out (`..`) or
/// is otherwise malformed.
pub struct Unpacker {
    dir: PathBuf,
    buf: Vec<u8>,
    state: State,
    files: usize,
    total: u64,
}

enum State {
    Magic,
    Header,
    Data { file: std::fs::File, left: u64 },
    Done,
}

fn refused(what: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::Refused, what)
}

/// Checks an archive path; the relative path it names.
fn checked_path(path: &str) -> ApiResult<PathBuf> {
    let ok = !path.is_empty()
        && !path.starts_with('/')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != ".." && !c.contains('\0'));
    if !ok {
        return Err(refused(format!(
            "the charm archive names `{path}`, not a relative path inside the charm"
        )));
    }
    Ok(PathBuf::from(path))
}

impl Unpacker {
    /// Unpacks into `dir`, which must not exist yet.
    pub fn new(dir: &Path) -> ApiResult<Unpacker> {
        std::fs::create_dir_all(dir)
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        Ok(Unpacker {
            dir: dir.to_path_buf(),
            buf: Vec::new(),
            state: State::Magic,
            files: 0,
            total: 0,
        })
    }

    /// Takes the next bytes of the archive.
    pub fn feed(&mut self, mut bytes: &[u8]) -> ApiResult<()> {
        let io = |e: std::io::Error| ApiError::new(ErrorCode::Internal, e.to_string());
        while !bytes.is_empty() {
            match &mut self.state {
                State::Done => return Err(refused("the charm archive goes on after its end")),
                State::Data { file, left } => {
                    let n = (*left).min(bytes.len() as u64) as usize;
                    file.write_all(&bytes[..n]).map_err(io)?;
                    *left -= n as u64;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.state = State::Header;
                    }
                }
                State::Magic | State::Header => {
                    // Headers are small: gather one whole, then act on it.
                    let need = match self.state {
                        State::Magic => 4,
                        _ => self.header_len(),
                    };
                    let take = need.saturating_sub(self.buf.len()).min(bytes.len());
                    self.buf.extend_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    if self.buf.len() < need {
                        continue;
                    }
                    if matches!(self.state, State::Magic) {
                        if self.buf != MAGIC {
                            return Err(refused("not a jujube charm archive"));
                        }
                        self.buf.clear();
                        self.state = State::Header;
                    } else if self.header_len() == need {
                        self.start_file()?;
                    }
                }
            }
        }
        Ok(())
    }

    /// How many bytes the header being read has, as far as is known: the
    /// path's length first, then the rest.
    fn header_len(&self) -> usize {
        if self.buf.len() < 2 {
            return 2;
        }
        let path = u16::from_be_bytes([self.buf[0], self.buf[1]]) as usize;
        if path == 0 {
            2
        } else {
            2 + path + 4 + 8
        }
    }

    fn start_file(&mut self) -> ApiResult<()> {
        let path_len = u16::from_be_bytes([self.buf[0], self.buf[1]]) as usize;
        if path_len == 0 {
            self.buf.clear();
            self.state = State::Done;
            return Ok(());
        }
        if path_len > MAX_PATH {
            return Err(refused(format!(
                "the charm archive names a path longer than {MAX_PATH} bytes"
            )));
        }
        let path = std::str::from_utf8(&self.buf[2..2 + path_len])
            .map_err(|_| refused("the charm archive names a path that is not UTF-8"))?
            .to_string();
        let rel = checked_path(&path)?;
        let at = 2 + path_len;
        let mode = u32::from_be_bytes(self.buf[at..at + 4].try_into().expect("4 bytes"));
        let len = u64::from_be_bytes(self.buf[at + 4..at + 12].try_into().expect("8 bytes"));
        self.buf.clear();
        self.files += 1;
        self.total = self.total.saturating_add(len);
        if self.files > MAX_CHARM_FILES {
            return Err(refused(format!(
                "the charm holds more than {MAX_CHARM_FILES} files"
            )));
        }
        if self.total > MAX_CHARM_BYTES as u64 {
            return Err(refused(format!(
                "the charm is larger than {} MiB; agents on other machines could not fetch it",
                MAX_CHARM_BYTES >> 20
            )));
        }
        let target = self.dir.join(rel);
        let io = |e: std::io::Error| ApiError::new(ErrorCode::Internal, e.to_string());
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            // Permission bits only: never set-id bits from a client.
            .mode(mode & 0o777)
            .open(&target)
            .map_err(|e| {
                refused(format!(
                    "the charm archive holds `{path}` twice, or under a file: {e}"
                ))
            })?;
        self.state = if len == 0 {
            State::Header
        } else {
            State::Data { file, left: len }
        };
        Ok(())
    }

    /// The archive ended: whether it was whole.
    pub fn finish(self) -> ApiResult<PathBuf> {
        match self.state {
            State::Done => Ok(self.dir),
            _ => Err(refused("the charm archive was cut short")),
        }
    }
}

/// Makes the charm directory `dir` from `archive` (a controller restoring
/// a charm another one kept): unpacked beside it, then renamed into place,
/// so that `dir` is whole or absent.
pub fn restore(dir: &Path, archive: &[u8]) -> ApiResult<()> {
    let io = |e: std::io::Error| ApiError::new(ErrorCode::Internal, e.to_string());
    let name = dir
        .file_name()
        .ok_or_else(|| refused(format!("`{}` cannot name a charm directory", dir.display())))?;
    let mut part = name.to_os_string();
    part.push(".restoring");
    let part = dir.with_file_name(part);
    match std::fs::remove_dir_all(&part) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
        _ => {}
    }
    let unpacked = Unpacker::new(&part).and_then(|mut u| {
        u.feed(archive)?;
        u.finish()?;
        std::fs::rename(&part, dir).map_err(io)
    });
    if unpacked.is_err() {
        let _ = std::fs::remove_dir_all(&part);
    }
    unpacked
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charm() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("metadata.yaml"), "name: x\n").unwrap();
        std::fs::create_dir(d.path().join("hooks")).unwrap();
        std::fs::write(d.path().join("hooks/install"), "#!/bin/sh\necho hi\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            d.path().join("hooks/install"),
            std::fs::Permissions::from_mode(0o4755),
        )
        .unwrap();
        std::os::unix::fs::symlink("install", d.path().join("hooks/start")).unwrap();
        d
    }

    #[test]
    fn a_restore_is_whole_or_leaves_nothing() {
        let src = charm();
        let mut bytes = Vec::new();
        write_archive(src.path(), &mut bytes).unwrap();
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("ab12");
        let e = restore(&dir, &bytes[..bytes.len() - 3]).unwrap_err();
        assert!(e.message.contains("cut short"), "{e:?}");
        let left: Vec<_> = std::fs::read_dir(out.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
        restore(&dir, &bytes).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("metadata.yaml")).unwrap(),
            "name: x\n"
        );
        assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 1);
    }

    #[test]
    fn an_archive_fed_a_byte_at_a_time_lays_out_the_charm_links_as_copies() {
        use std::os::unix::fs::PermissionsExt;
        let src = charm();
        let mut bytes = Vec::new();
        write_archive(src.path(), &mut bytes).unwrap();
        let out = tempfile::tempdir().unwrap();
        let mut u = Unpacker::new(&out.path().join("c")).unwrap();
        for b in &bytes {
            u.feed(std::slice::from_ref(b)).unwrap();
        }
        let dir = u.finish().unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("metadata.yaml")).unwrap(),
            "name: x\n"
        );
        let start = dir.join("hooks/start");
        assert!(!std::fs::symlink_metadata(&start)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read_to_string(start).unwrap(),
            "#!/bin/sh\necho hi\n"
        );
        // The set-uid bit did not travel.
        let mode = std::fs::metadata(dir.join("hooks/install"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755);
    }

    fn archive(path: &str, len: u64, data: &[u8]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend((path.len() as u16).to_be_bytes());
        b.extend(path.as_bytes());
        b.extend(0o644u32.to_be_bytes());
        b.extend(len.to_be_bytes());
        b.extend(data);
        b
    }

    #[test]
    fn paths_out_of_the_charm_oversized_and_cut_archives_are_refused() {
        let out = tempfile::tempdir().unwrap();
        for (i, bad) in ["../x", "/etc/x", "a//b", "a/./b", ""].iter().enumerate() {
            let mut u = Unpacker::new(&out.path().join(format!("p{i}"))).unwrap();
            let mut bytes = archive(bad, 1, b"x");
            bytes.extend(0u16.to_be_bytes());
            let r = u.feed(&bytes).and_then(|_| u.finish().map(|_| ()));
            assert!(r.is_err(), "{bad:?} was accepted");
        }
        assert!(!out.path().join("x").exists());
        let mut u = Unpacker::new(&out.path().join("big")).unwrap();
        let e = u
            .feed(&archive("f", MAX_CHARM_BYTES as u64 + 1, b""))
            .unwrap_err();
        assert!(e.message.contains("larger than"), "{}", e.message);
        let mut u = Unpacker::new(&out.path().join("cut")).unwrap();
        u.feed(&archive("f", 10, b"12345")).unwrap();
        assert!(u.finish().is_err());
        let mut u = Unpacker::new(&out.path().join("magic")).unwrap();
        assert!(u.feed(b"PK\x03\x04").is_err());
    }
}
