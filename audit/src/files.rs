//! The data directory's files: created owner-only whatever the umask, and
//! checked at start.
//!
//! Everything under `--data DIR` is canarygate's: the store (which holds
//! sampled and blocked prompts and answers, in clear without a sample key),
//! the install secret, probe results. Directories are created 0700 and files
//! 0600, with an explicit `chmod` after creating them, so neither a lax
//! umask (`000`) nor one that locks the owner out (`777`) changes the
//! result.
//! [`check_data_dir`] refuses a directory, or a file in it, that its group or
//! others can reach, unless `[audit] data_readable_by` allows it.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use canarygate_policies::config::DataReaders;

use crate::AuditError;

/// Mode of every directory canarygate creates in its data directory.
pub const PRIVATE_DIR_MODE: u32 = 0o700;
/// Mode of every file canarygate creates in its data directory.
pub const PRIVATE_FILE_MODE: u32 = 0o600;

/// Creates `dir` and any missing parent, each 0700 whatever the umask.
/// Directories that exist are left as they are.
pub fn create_private_dir_all(dir: &Path) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut cursor = Some(dir);
    while let Some(path) = cursor {
        if path.as_os_str().is_empty() || path.is_dir() {
            break;
        }
        missing.push(path);
        cursor = path.parent();
    }
    for path in missing.into_iter().rev() {
        let mut builder = fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, PRIVATE_DIR_MODE);
        match builder.create(path) {
            Ok(()) => set_mode(path, PRIVATE_DIR_MODE)?,
            // Created meanwhile by someone else: theirs to set.
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists && path.is_dir() => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Creates `path` (which must not exist) 0600 whatever the umask, opened
/// for writing.
pub fn create_private_file(path: &Path) -> io::Result<fs::File> {
    let mut options = fs::OpenOptions::new();
    options.read(true).write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, PRIVATE_FILE_MODE);
    let file = options.open(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(fs::Permissions::from_mode(PRIVATE_FILE_MODE))?;
    }
    Ok(file)
}

/// Creates `path` empty and 0600 when it is missing; leaves it alone when it
/// exists (another process may hold it open).
pub fn ensure_private_file(path: &Path) -> io::Result<()> {
    match create_private_file(path) {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(error) => Err(error),
    }
}

/// Replaces `path` with `bytes` atomically (a 0600 temporary file in the
/// same directory, synced, then renamed over it); creates the directory
/// 0700 when missing.
pub fn write_private_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_private_dir_all(dir)?;
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |name| name.to_string_lossy().into_owned());
    let temporary = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = fs::remove_file(&temporary);
    let written = create_private_file(&temporary).and_then(|mut file| {
        file.write_all(bytes)?;
        file.sync_all()
    });
    match written.and_then(|()| fs::rename(&temporary, path)) {
        Ok(()) => Ok(()),
        Err(error) => {
            let _ = fs::remove_file(&temporary);
            Err(error)
        }
    }
}

/// Prepares `dir` for `serve`: creates it 0700 when missing; otherwise
/// checks the directory and everything in it (one level of subdirectories
/// deep, which is all canarygate writes) against `allowed`.
pub fn prepare_data_dir(dir: &Path, allowed: DataReaders) -> Result<(), AuditError> {
    if !dir.exists() {
        return create_private_dir_all(dir).map_err(|error| {
            AuditError::Io(format!(
                "cannot create data directory {}: {error}",
                dir.display()
            ))
        });
    }
    check_data_dir(dir, allowed)
}

/// Refuses `dir` when it, a file in it or a file in one of its
/// subdirectories gives its group or others more than `allowed`. The error
/// names every such path with its mode, and the fix.
pub fn check_data_dir(dir: &Path, allowed: DataReaders) -> Result<(), AuditError> {
    let forbidden = match allowed {
        DataReaders::Owner => 0o077,
        DataReaders::Group => 0o007,
        DataReaders::Anyone => return Ok(()),
    };
    let io = |path: &Path, error: io::Error| {
        AuditError::Io(format!("cannot inspect {}: {error}", path.display()))
    };
    let mut exposed: Vec<(PathBuf, u32)> = Vec::new();
    let mut look = |path: &Path| -> Result<bool, AuditError> {
        let metadata = fs::metadata(path).map_err(|error| io(path, error))?;
        let mode = mode_of(&metadata);
        if mode & forbidden != 0 {
            exposed.push((path.to_owned(), mode));
        }
        Ok(metadata.is_dir())
    };
    look(dir)?;
    let owner = owner_of(dir).map_err(|error| io(dir, error))?;
    for entry in fs::read_dir(dir).map_err(|error| io(dir, error))? {
        let path = entry.map_err(|error| io(dir, error))?.path();
        // Only the directory's owner's subdirectories are canarygate's to
        // look into: a volume's root holds `lost+found`, owned by root and
        // closed to us (its own mode is still checked).
        if look(&path)? && owner_of(&path).map_err(|error| io(&path, error))? == owner {
            for inner in fs::read_dir(&path).map_err(|error| io(&path, error))? {
                look(&inner.map_err(|error| io(&path, error))?.path())?;
            }
        }
    }
    if exposed.is_empty() {
        return Ok(());
    }
    let (who, fix) = match allowed {
        DataReaders::Group => ("others", "o-rwx"),
        _ => ("its group or others", "go-rwx"),
    };
    let listed: Vec<String> = exposed
        .iter()
        .map(|(path, mode)| format!("{} (mode {mode:04o})", path.display()))
        .collect();
    Err(AuditError::Exposed(format!(
        "the data directory can be read by {who}: {}. It holds the audit store, whose samples \
         keep prompts and answers, and the install secret. Run `chmod -R {fix} {}`, or set \
         [audit] data_readable_by = \"{}\" to accept it.",
        listed.join(", "),
        dir.display(),
        match allowed {
            DataReaders::Owner => "group",
            _ => "anyone",
        }
    )))
}

/// The user owning `path` (no owners off Unix: every path is "ours").
fn owner_of(path: &Path) -> io::Result<u32> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        Ok(fs::metadata(path)?.uid())
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        Ok(0)
    }
}

fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
    }
    #[cfg(not(unix))]
    {
        let _ = (path, mode);
        Ok(())
    }
}

fn mode_of(metadata: &fs::Metadata) -> u32 {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        metadata.permissions().mode() & 0o7777
    }
    #[cfg(not(unix))]
    {
        let _ = metadata;
        PRIVATE_FILE_MODE
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    // The umask is the process's, so its effect is tested with real
    // processes (tests/e2e/hostile_clients.rs); these check the checks.

    #[test]
    fn created_dirs_and_files_are_owner_only() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b/data");
        create_private_dir_all(&dir).unwrap();
        for path in [root.path().join("a"), root.path().join("a/b"), dir.clone()] {
            assert_eq!(mode(&path), 0o700, "{}", path.display());
        }
        let file = dir.join("probes/x.json");
        write_private_file(&file, b"{}").unwrap();
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(&dir.join("probes")), 0o700);
        assert_eq!(fs::read(&file).unwrap(), b"{}");
        write_private_file(&file, b"[]").unwrap();
        assert_eq!(fs::read(&file).unwrap(), b"[]");
        assert_eq!(fs::read_dir(dir.join("probes")).unwrap().count(), 1);
        check_data_dir(&dir, DataReaders::Owner).unwrap();
    }

    #[test]
    fn exposed_paths_are_named_unless_allowed() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("data");
        create_private_dir_all(&dir).unwrap();
        ensure_private_file(&dir.join("canarygate.redb")).unwrap();
        write_private_file(&dir.join("probes/p.json"), b"{}").unwrap();
        check_data_dir(&dir, DataReaders::Owner).unwrap();

        fs::set_permissions(dir.join("probes/p.json"), fs::Permissions::from_mode(0o640)).unwrap();
        let error = check_data_dir(&dir, DataReaders::Owner).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("p.json (mode 0640)"), "{text}");
        assert!(text.contains("chmod -R go-rwx"), "{text}");
        assert!(text.contains("data_readable_by = \"group\""), "{text}");
        check_data_dir(&dir, DataReaders::Group).unwrap();

        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        let text = check_data_dir(&dir, DataReaders::Group)
            .unwrap_err()
            .to_string();
        assert!(text.contains("(mode 0755)"), "{text}");
        assert!(!text.contains("p.json"), "group read is allowed: {text}");
        check_data_dir(&dir, DataReaders::Anyone).unwrap();
    }

    #[test]
    fn another_users_subdirectory_is_not_looked_into() {
        // The root of a freshly formatted volume holds `lost+found`, root's
        // and 0700: `serve --data /mnt/volume` must not need to read it.
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("data");
        create_private_dir_all(&dir).unwrap();
        let foreign = dir.join("lost+found");
        fs::create_dir(&foreign).unwrap();
        fs::set_permissions(&foreign, fs::Permissions::from_mode(0o700)).unwrap();
        fs::write(foreign.join("inode"), b"").unwrap();
        fs::set_permissions(foreign.join("inode"), fs::Permissions::from_mode(0o644)).unwrap();
        let nobody = 65534;
        if std::os::unix::fs::chown(&foreign, Some(nobody), Some(nobody)).is_err() {
            // Giving a directory away takes root; as anyone else the case
            // cannot be built.
            eprintln!("not root: cannot hand a subdirectory to another user");
            return;
        }
        check_data_dir(&dir, DataReaders::Owner).unwrap();
        // Its own mode still counts.
        fs::set_permissions(&foreign, fs::Permissions::from_mode(0o755)).unwrap();
        let text = check_data_dir(&dir, DataReaders::Owner)
            .unwrap_err()
            .to_string();
        assert!(text.contains("lost+found (mode 0755)"), "{text}");
        assert!(!text.contains("inode"), "{text}");
    }
}
