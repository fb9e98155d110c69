//! What the store's, the staging's and the floors' segments share: one error for why one
//! could not be made or taken over, and making, taking over and removing a locked one.

/// Why a segment could not be made or taken over.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// The call and its purpose.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The segment is not one this daemon can take over.
    #[error("shared memory segment {id} is not a uzram segment this daemon can serve: {why}")]
    Foreign {
        /// The segment id.
        id: i32,
        /// What did not match.
        why: String,
    },
    /// The segment is not root's alone, or a call on it failed.
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
}

impl SegmentError {
    /// Whether the segment could not be taken over for want of memory or of a lock's room
    /// now (`ENOMEM`, `EAGAIN`, `EINTR` from a call), which says nothing of what it holds: a
    /// later try may take it, so it must not be given up for it.
    pub fn is_for_now(&self) -> bool {
        let errno = match self {
            SegmentError::Sys { source, .. } => source.raw_os_error(),
            SegmentError::Shm(crate::shm::ShmError::Sys { source, .. }) => source.raw_os_error(),
            SegmentError::Foreign { .. } | SegmentError::Shm(_) => None,
        };
        matches!(errno, Some(libc::ENOMEM | libc::EAGAIN | libc::EINTR))
    }
}

/// Maps a failed system call's error, naming the call.
pub fn sys(what: &'static str) -> impl FnOnce(std::io::Error) -> SegmentError {
    move |source| SegmentError::Sys { what, source }
}

/// A segment that is not one this daemon can take over, and why.
pub fn foreign(id: i32, why: String) -> SegmentError {
    SegmentError::Foreign { id, why }
}

/// A new root-only segment of `len` bytes that starts with `header`, locked (`SHM_LOCK`) and
/// populated (`mlock`, failing as `populating`), mapped for the rest of the process: its id
/// and the mapping's address. With `scratch`, it is marked for removal before anything of it
/// is locked or touched (it goes with this process, however it ends); otherwise its header
/// says what it is before it is locked, so that `uzram list` finds it should this process die
/// before a store records it. On failure nothing is left behind.
pub fn create_locked<H: Copy>(
    len: usize,
    header: H,
    scratch: bool,
    populating: &'static str,
) -> Result<(i32, usize), SegmentError> {
    assert!(
        std::mem::size_of::<H>() <= len,
        "a header longer than its segment"
    );
    let id = crate::shm::create(len)?;
    let mapped = crate::shm::Attached::map(id, false);
    if scratch || mapped.is_err() {
        remove_logged(id);
    }
    let base = mapped?.keep();
    // SAFETY: the header lies in our fresh read-write mapping of `len` bytes (asserted above);
    // nobody else knows the segment yet.
    unsafe { std::ptr::write_volatile(base as *mut H, header) };
    let made = crate::shm::lock(id)
        .map_err(SegmentError::from)
        .and_then(|()| crate::sys::memory::lock(base, len).map_err(sys(populating)));
    if let Err(e) = made {
        remove_logged(id);
        // SAFETY: our own mapping, made above; nothing of it was handed out.
        unsafe { crate::shm::detach(base) };
        return Err(e);
    }
    Ok((id, base))
}

/// Takes over segment `id`, whose `header` (`len` bytes in all) the caller read and checked
/// through a read-only mapping: locks it, maps it for the rest of the process, reads the
/// header again through the new mapping (what the caller's slices will rely on) and
/// populates it (`mlock`, failing as `populating`). Returns the mapping's address; on failure
/// nothing stays mapped and the segment is left as it was.
pub fn attach_locked<H: Copy + PartialEq>(
    id: i32,
    header: H,
    len: usize,
    populating: &'static str,
) -> Result<usize, SegmentError> {
    // Mapped (and so checked root's alone) before it is locked: never lock another's memory.
    let mapped = crate::shm::Attached::map(id, false)?;
    if mapped.size() < len {
        // The id was freed and reused since the caller read the header through its own
        // mapping: the slices handed out would reach past this one's end.
        return Err(foreign(
            id,
            format!(
                "it is {} bytes, not the {len} its header names",
                mapped.size()
            ),
        ));
    }
    let base = mapped.keep();
    if let Err(e) = crate::shm::lock(id) {
        // SAFETY: our own mapping, made above; nothing refers to it.
        unsafe { crate::shm::detach(base) };
        return Err(e.into());
    }
    // SAFETY: the caller checked that the segment holds at least a header (`len` bytes).
    let again = unsafe { std::ptr::read_volatile(base as *const H) };
    let populated = if again == header {
        crate::sys::memory::lock(base, len).map_err(sys(populating))
    } else {
        Err(foreign(
            id,
            "its header changed while it was taken over".into(),
        ))
    };
    if let Err(e) = populated {
        // SAFETY: our own mapping, made above; nothing refers to it.
        unsafe { crate::shm::detach(base) };
        return Err(e);
    }
    Ok(base)
}

/// Marks segment `id` for removal, logging a failure.
pub fn remove_logged(id: i32) {
    if let Err(error) = crate::shm::remove(id) {
        tracing::warn!(id, %error, "removing a shared memory segment failed");
    }
}

/// Marks segment `id`, as a store records it, for removal when `found` (its header read and
/// checked) says it is of the kind recorded; one that is not (the id was freed and reused by
/// someone else) is left alone, with a warning naming `what`.
pub fn remove_recorded<H>(id: i32, found: Result<H, SegmentError>, what: &str) {
    match found {
        Ok(_) => remove_logged(id),
        Err(error) => tracing::warn!(id, %error, "not removing {}", what),
    }
}

/// Checks each kind of recorded segment runs against the segments it must not take.
#[cfg(test)]
pub mod tests {

    /// Only a call short of memory or room now is a failure for now: a segment that is not
    /// there, not a uzram one or not root's alone is given up.
    #[test]
    fn only_a_call_short_of_memory_fails_for_now() {
        let call = |errno| SegmentError::Sys {
            what: "mlock",
            source: std::io::Error::from_raw_os_error(errno),
        };
        assert!(call(libc::ENOMEM).is_for_now());
        assert!(call(libc::EAGAIN).is_for_now());
        let shm = SegmentError::Shm(crate::shm::ShmError::Sys {
            what: "shmat",
            source: std::io::Error::from_raw_os_error(libc::ENOMEM),
        });
        assert!(shm.is_for_now());
        assert!(!call(libc::EINVAL).is_for_now(), "a segment that is gone");
        assert!(!call(libc::EIDRM).is_for_now());
        assert!(!super::foreign(1, "no header".into()).is_for_now());
        let theirs = SegmentError::Shm(crate::shm::ShmError::NotRootOnly {
            id: 1,
            uid: 65534,
            cuid: 65534,
            mode: 0o600,
        });
        assert!(!theirs.is_for_now());
    }
    use super::{remove_logged, SegmentError};

    /// A segment of someone else's under a recorded id (freed and reused): `attach` refuses
    /// it, saying `refusal`, and `remove` leaves it.
    pub fn another_segment_is_left_alone<T>(
        attach: impl Fn(i32) -> Result<T, SegmentError>,
        remove: fn(i32),
        refusal: &str,
    ) {
        let Ok(id) = crate::shm::create(65536) else {
            println!("SKIP: no SysV shared memory");
            return;
        };
        let Err(err) = attach(id) else {
            panic!("someone else's segment was taken over");
        };
        assert!(err.to_string().contains(refusal), "{err}");
        remove(id);
        assert!(
            crate::shm::stat(id).is_ok(),
            "someone else's segment was removed"
        );
        remove_logged(id);
        assert!(crate::shm::stat(id).is_err());
    }

    /// The attack on a recorded segment itself: a local user makes one of `size` bytes that
    /// starts with the kind's own `header`. `attach` refuses it as not root's, and `remove`
    /// leaves it.
    pub fn a_copy_another_user_made_is_refused<T>(
        size: usize,
        header: &[u8],
        attach: impl Fn(i32) -> Result<T, SegmentError>,
        remove: fn(i32),
    ) {
        let Some(id) = crate::shm::tests::nobodys_segment(0, size, 0o666) else {
            return;
        };
        crate::shm::tests::write_as_owner(id, header);
        let Err(err) = attach(id) else {
            panic!("a segment another user made was taken over");
        };
        assert!(err.to_string().contains("not root's alone"), "{err}");
        remove(id);
        assert!(crate::shm::stat(id).is_ok(), "nobody's segment was removed");
        crate::shm::remove(id).unwrap();
    }
}
