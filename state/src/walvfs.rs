//! A SQLite VFS over the platform's default one that writes each commit's
//! WAL frames with one `write` call instead of two per page.
//!
//! SQLite appends a frame to the write-ahead log as two writes: the
//! frame's 24-byte header, then its page. An add-unit's commit carries
//! about ten pages, so twenty `pwrite` calls, each paying the kernel's
//! per-call costs (entry, file lookup, page-cache locking, dirtying the
//! block it touches twice): over a quarter of the CPU an add-unit cost
//! besides its fsync. This VFS gathers contiguous writes to a WAL file in
//! memory and issues them as one write.
//!
//! # Guarantees
//!
//! - **Nothing is published unwritten.** A frame whose header marks it as
//!   a commit frame (a non-zero database size, bytes 4..8 of its header)
//!   is written out, with everything gathered before it, before the write
//!   of its page returns; and a sync writes out whatever is gathered. With
//!   `synchronous = FULL`, the only setting the store opens this VFS with,
//!   SQLite syncs the log before it publishes a commit's frames to readers
//!   in the WAL index, so the file holds what SQLite believes it wrote by
//!   the time anything else may look. A failed write out fails the call
//!   that made it (a frame's write, the sync), and SQLite abandons the
//!   commit as it would on any failed write.
//! - **Every other look at the file sees the gathered bytes.** Reads,
//!   syncs, truncation, size queries, file controls, locks and close write
//!   out what is gathered first; so does a write that does not continue
//!   the gathered run (SQLite overwriting a frame of the same transaction).
//! - **Bounded.** At most [`GATHER_MAX`] bytes are held per WAL file (one
//!   writer connection per store): a larger transaction (one that spills
//!   pages before its commit, or a batch of a thousand rows) is written out
//!   in runs of about that size.
//! - Files other than WAL files are the default VFS's own, untouched (the
//!   same object, the same methods: no call goes through this code).

use rusqlite::ffi;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// The name connections open with (`open_with_flags_and_vfs`).
pub(crate) const NAME: &CStr = c"jujube-wal";

/// The most bytes a WAL file gathers before writing them out, and the
/// most one write carries: six times what an add-unit's commit writes
/// (ten frames of 1 KiB). SQLite's unix VFS writes at most 128 KiB less
/// one byte in one call.
pub(crate) const GATHER_MAX: usize = 64 << 10;

/// A WAL frame's header.
const FRAME_HEADER: usize = 24;

/// How many `write` calls `conn` made to its WAL file since it opened or
/// this was last asked with `reset`; `None` for a connection whose WAL file
/// is not this VFS's (or not open yet).
pub(crate) fn writes(conn: &rusqlite::Connection, reset: bool) -> Option<u64> {
    let mut file: *mut ffi::sqlite3_file = std::ptr::null_mut();
    // SAFETY: the handle is `conn`'s own and open; the file control only
    // stores the WAL file's pointer (SQLite's own object, alive while the
    // connection is and not in use by another thread: the connection is
    // `conn`, borrowed here). Its methods tell whether it is a `WalFile`.
    unsafe {
        let rc = ffi::sqlite3_file_control(
            conn.handle(),
            c"main".as_ptr(),
            ffi::SQLITE_FCNTL_JOURNAL_POINTER,
            (&raw mut file).cast(),
        );
        let ours = WAL_METHODS.get().map(|m| m as *const _);
        if rc != ffi::SQLITE_OK || file.is_null() || Some((*file).pMethods) != ours {
            return None;
        }
        let g = &mut *(*file.cast::<WalFile>()).gathered;
        let n = g.writes;
        if reset {
            g.writes = 0;
        }
        Some(n)
    }
}

/// Registers the VFS (once; not as the default) and returns whether it is
/// there to use. It is missing only if SQLite has no default VFS.
pub(crate) fn register() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        // SAFETY: `sqlite3_vfs_find(NULL)` returns the default VFS, which
        // SQLite keeps for the process's life. The VFS built here is leaked,
        // so it outlives every connection that names it.
        unsafe {
            let real = ffi::sqlite3_vfs_find(std::ptr::null());
            if real.is_null() {
                return false;
            }
            let vfs = Box::leak(Box::new(ffi::sqlite3_vfs {
                iVersion: 2,
                szOsFile: (REAL_AT + (*real).szOsFile as usize) as c_int,
                mxPathname: (*real).mxPathname,
                pNext: std::ptr::null_mut(),
                zName: NAME.as_ptr(),
                pAppData: real.cast(),
                xOpen: Some(open),
                xDelete: Some(delete),
                xAccess: Some(access),
                xFullPathname: Some(full_pathname),
                xDlOpen: Some(dl_open),
                xDlError: Some(dl_error),
                xDlSym: Some(dl_sym),
                xDlClose: Some(dl_close),
                xRandomness: Some(randomness),
                xSleep: Some(sleep),
                xCurrentTime: Some(current_time),
                xGetLastError: Some(get_last_error),
                xCurrentTimeInt64: Some(current_time_int64),
                xSetSystemCall: None,
                xGetSystemCall: None,
                xNextSystemCall: None,
            }));
            ffi::sqlite3_vfs_register(vfs, 0) == ffi::SQLITE_OK
        }
    })
}

/// A WAL file: SQLite's handle, then what is gathered, then (at
/// [`REAL_AT`]) the default VFS's own file.
#[repr(C)]
struct WalFile {
    base: ffi::sqlite3_file,
    gathered: *mut Gathered,
}

/// Contiguous bytes not yet written, from `offset`.
struct Gathered {
    offset: i64,
    bytes: Vec<u8>,
    /// The last write was a commit frame's header: its page ends the
    /// commit's frames.
    commit_next: bool,
    /// Writes made to the file, for [`writes`].
    writes: u64,
}

/// Where the default VFS's file starts in ours, aligned for any field.
const REAL_AT: usize = std::mem::size_of::<WalFile>().next_multiple_of(16);

unsafe fn real_vfs(vfs: *mut ffi::sqlite3_vfs) -> *mut ffi::sqlite3_vfs {
    (*vfs).pAppData.cast()
}

unsafe fn real_file(f: *mut ffi::sqlite3_file) -> *mut ffi::sqlite3_file {
    f.cast::<u8>().add(REAL_AT).cast()
}

unsafe fn real_methods(f: *mut ffi::sqlite3_file) -> &'static ffi::sqlite3_io_methods {
    &*(*real_file(f)).pMethods
}

static WAL_METHODS: OnceLock<ffi::sqlite3_io_methods> = OnceLock::new();

unsafe extern "C" fn open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let real = real_vfs(vfs);
    let Some(real_open) = (*real).xOpen else {
        return ffi::SQLITE_CANTOPEN;
    };
    if flags & ffi::SQLITE_OPEN_WAL == 0 {
        // Any other file is the default VFS's, in the same place: SQLite
        // calls its methods directly.
        return real_open(real, name, file, flags, out_flags);
    }
    (*file).pMethods = std::ptr::null();
    let inner = real_file(file);
    let rc = real_open(real, name, inner, flags, out_flags);
    if rc != ffi::SQLITE_OK {
        // SQLite closes a file whose open failed only if it has methods;
        // the default VFS's own close, if it set any, frees what it holds.
        if !(*inner).pMethods.is_null() {
            if let Some(close) = (*(*inner).pMethods).xClose {
                close(inner);
            }
        }
        return rc;
    }
    let methods = WAL_METHODS.get_or_init(|| wal_methods(&*(*inner).pMethods));
    let wal = file.cast::<WalFile>();
    (*wal).gathered = Box::into_raw(Box::new(Gathered {
        offset: 0,
        bytes: Vec::new(),
        commit_next: false,
        writes: 0,
    }));
    (*wal).base.pMethods = methods;
    ffi::SQLITE_OK
}

/// The WAL file's methods: the default VFS's version, each one writing
/// out what is gathered before it acts.
fn wal_methods(real: &ffi::sqlite3_io_methods) -> ffi::sqlite3_io_methods {
    ffi::sqlite3_io_methods {
        iVersion: real.iVersion.min(3),
        xClose: Some(close),
        xRead: Some(read),
        xWrite: Some(write),
        xTruncate: Some(truncate),
        xSync: Some(sync),
        xFileSize: Some(file_size),
        xLock: Some(lock),
        xUnlock: Some(unlock),
        xCheckReservedLock: Some(check_reserved_lock),
        xFileControl: Some(file_control),
        xSectorSize: Some(sector_size),
        xDeviceCharacteristics: Some(device_characteristics),
        xShmMap: real.xShmMap.map(|_| shm_map as _),
        xShmLock: real.xShmLock.map(|_| shm_lock as _),
        xShmBarrier: real.xShmBarrier.map(|_| shm_barrier as _),
        xShmUnmap: real.xShmUnmap.map(|_| shm_unmap as _),
        xFetch: real.xFetch.map(|_| fetch as _),
        xUnfetch: real.xUnfetch.map(|_| unfetch as _),
    }
}

/// Writes out what `f` has gathered; SQLite's result code.
unsafe fn write_out(f: *mut ffi::sqlite3_file) -> c_int {
    let g = &mut *(*f.cast::<WalFile>()).gathered;
    if g.bytes.is_empty() {
        return ffi::SQLITE_OK;
    }
    let Some(real_write) = real_methods(f).xWrite else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    // A gathered run never passes GATHER_MAX (a write that would take it
    // past writes out what is gathered first, and one page is at most
    // 64 KiB), so it is one call.
    g.writes += 1;
    let rc = real_write(
        real_file(f),
        g.bytes.as_ptr().cast(),
        g.bytes.len() as c_int,
        g.offset,
    );
    g.bytes.clear();
    rc
}

unsafe extern "C" fn write(
    f: *mut ffi::sqlite3_file,
    data: *const c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    let g = &mut *(*f.cast::<WalFile>()).gathered;
    let amount = amount.max(0) as usize;
    let continues = offset == g.offset + g.bytes.len() as i64;
    if !g.bytes.is_empty() && (!continues || g.bytes.len() + amount > GATHER_MAX) {
        let rc = write_out(f);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
    }
    let g = &mut *(*f.cast::<WalFile>()).gathered;
    if g.bytes.is_empty() {
        g.offset = offset;
    }
    let bytes = std::slice::from_raw_parts(data.cast::<u8>(), amount);
    g.bytes.extend_from_slice(bytes);
    // Pages are at least 512 bytes and the log's own header 32: a write of
    // 24 bytes is a frame header, and one with a database size is a commit
    // frame's, whose page (the next write) ends the commit.
    let commit_header = amount == FRAME_HEADER && bytes[4..8] != [0; 4];
    let ends_commit = std::mem::replace(&mut g.commit_next, commit_header);
    if ends_commit {
        return write_out(f);
    }
    ffi::SQLITE_OK
}

unsafe extern "C" fn close(f: *mut ffi::sqlite3_file) -> c_int {
    let rc = write_out(f);
    let wal = f.cast::<WalFile>();
    drop(Box::from_raw((*wal).gathered));
    (*wal).gathered = std::ptr::null_mut();
    let closed = match real_methods(f).xClose {
        Some(close) => close(real_file(f)),
        None => ffi::SQLITE_OK,
    };
    if rc != ffi::SQLITE_OK {
        rc
    } else {
        closed
    }
}

/// Defines a method that writes out what is gathered, then calls the
/// default VFS's.
macro_rules! after_write_out {
    ($name:ident, $method:ident, ($($arg:ident: $ty:ty),*)) => {
        unsafe extern "C" fn $name(f: *mut ffi::sqlite3_file, $($arg: $ty),*) -> c_int {
            let rc = write_out(f);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            match real_methods(f).$method {
                Some(m) => m(real_file(f), $($arg),*),
                None => ffi::SQLITE_IOERR,
            }
        }
    };
}

after_write_out!(read, xRead, (data: *mut c_void, amount: c_int, offset: i64));
after_write_out!(truncate, xTruncate, (size: i64));
after_write_out!(sync, xSync, (flags: c_int));
after_write_out!(file_size, xFileSize, (size: *mut i64));
after_write_out!(lock, xLock, (level: c_int));
after_write_out!(unlock, xUnlock, (level: c_int));
after_write_out!(check_reserved_lock, xCheckReservedLock, (out: *mut c_int));
after_write_out!(file_control, xFileControl, (op: c_int, arg: *mut c_void));
after_write_out!(shm_map, xShmMap, (page: c_int, size: c_int, extend: c_int, out: *mut *mut c_void));
after_write_out!(shm_lock, xShmLock, (offset: c_int, n: c_int, flags: c_int));
after_write_out!(shm_unmap, xShmUnmap, (delete: c_int));
after_write_out!(fetch, xFetch, (offset: i64, amount: c_int, out: *mut *mut c_void));
after_write_out!(unfetch, xUnfetch, (offset: i64, p: *mut c_void));

unsafe extern "C" fn sector_size(f: *mut ffi::sqlite3_file) -> c_int {
    real_methods(f)
        .xSectorSize
        .map_or(4096, |m| m(real_file(f)))
}

unsafe extern "C" fn device_characteristics(f: *mut ffi::sqlite3_file) -> c_int {
    real_methods(f)
        .xDeviceCharacteristics
        .map_or(0, |m| m(real_file(f)))
}

unsafe extern "C" fn shm_barrier(f: *mut ffi::sqlite3_file) {
    if write_out(f) == ffi::SQLITE_OK {
        if let Some(m) = real_methods(f).xShmBarrier {
            m(real_file(f));
        }
    }
}

// The VFS's own calls, passed to the default VFS with its own pointer.

/// Defines a VFS call that makes the default VFS's, or answers `$missing`
/// if it has none.
macro_rules! to_real_vfs {
    ($name:ident, $method:ident, $missing:expr, ($($arg:ident: $ty:ty),*)) => {
        unsafe extern "C" fn $name(vfs: *mut ffi::sqlite3_vfs, $($arg: $ty),*) -> c_int {
            let real = real_vfs(vfs);
            (*real).$method.map_or($missing, |m| m(real, $($arg),*))
        }
    };
}

to_real_vfs!(delete, xDelete, ffi::SQLITE_IOERR_DELETE, (name: *const c_char, dir: c_int));
to_real_vfs!(access, xAccess, ffi::SQLITE_IOERR_ACCESS, (name: *const c_char, flags: c_int, out: *mut c_int));
to_real_vfs!(full_pathname, xFullPathname, ffi::SQLITE_CANTOPEN, (name: *const c_char, n: c_int, out: *mut c_char));
to_real_vfs!(randomness, xRandomness, 0, (n: c_int, out: *mut c_char));
to_real_vfs!(sleep, xSleep, 0, (micros: c_int));
to_real_vfs!(current_time, xCurrentTime, ffi::SQLITE_ERROR, (out: *mut f64));
to_real_vfs!(get_last_error, xGetLastError, 0, (n: c_int, out: *mut c_char));

unsafe extern "C" fn dl_open(vfs: *mut ffi::sqlite3_vfs, name: *const c_char) -> *mut c_void {
    let real = real_vfs(vfs);
    (*real)
        .xDlOpen
        .map_or(std::ptr::null_mut(), |m| m(real, name))
}

unsafe extern "C" fn dl_error(vfs: *mut ffi::sqlite3_vfs, n: c_int, out: *mut c_char) {
    let real = real_vfs(vfs);
    if let Some(m) = (*real).xDlError {
        m(real, n, out)
    }
}

type DlSym = unsafe extern "C" fn(*mut ffi::sqlite3_vfs, *mut c_void, *const c_char);

unsafe extern "C" fn dl_sym(
    vfs: *mut ffi::sqlite3_vfs,
    handle: *mut c_void,
    symbol: *const c_char,
) -> Option<DlSym> {
    let real = real_vfs(vfs);
    (*real).xDlSym.and_then(|m| m(real, handle, symbol))
}

unsafe extern "C" fn dl_close(vfs: *mut ffi::sqlite3_vfs, handle: *mut c_void) {
    let real = real_vfs(vfs);
    if let Some(m) = (*real).xDlClose {
        m(real, handle)
    }
}

unsafe extern "C" fn current_time_int64(vfs: *mut ffi::sqlite3_vfs, out: *mut i64) -> c_int {
    let real = real_vfs(vfs);
    match (*real).xCurrentTimeInt64 {
        Some(m) => m(real, out),
        None => {
            let mut days = 0.0;
            let rc = current_time(vfs, &mut days);
            *out = (days * 86_400_000.0) as i64;
            rc
        }
    }
}
