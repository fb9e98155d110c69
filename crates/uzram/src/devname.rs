//! Device names as users type them: `/dev/ublkbN`, `ublkbN` or `N`.

/// Parses a device name into its id.
pub fn parse_device(name: &str) -> Result<u32, String> {
    let n = name.trim();
    // The swap node (`swapon --show` lists it) names the same device.
    let digits = n
        .strip_prefix("/dev/ublkb")
        .or_else(|| n.strip_prefix("/dev/zram-uzram/ublkb"))
        .or_else(|| n.strip_prefix("ublkb"))
        .unwrap_or(n);
    // No leading zero: no node `/dev/ublkb01` exists, and taking it for device 1 would act
    // on a device nobody named.
    let leading_zero = digits.len() > 1 && digits.starts_with('0');
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || leading_zero {
        return Err(format!(
            "invalid device {name:?}: expected /dev/ublkbN, /dev/zram-uzram/ublkbN, ublkbN or N"
        ));
    }
    let max = crate::config::MAX_ID;
    digits
        .parse()
        .ok()
        .filter(|&id| id <= max)
        .ok_or_else(|| format!("invalid device {name:?}: ublk device ids go up to {max}"))
}

/// `/dev/ublkbN`.
pub fn dev_path(id: u32) -> String {
    format!("/dev/ublkb{id}")
}

/// Whether the kernel still has ublk device `id` (its char device, which a daemon that
/// stops deletes with the device and which a crash leaves in place).
pub fn in_kernel(id: u32) -> bool {
    std::path::Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_three_spellings() {
        assert_eq!(parse_device("/dev/ublkb3"), Ok(3));
        assert_eq!(parse_device("ublkb12"), Ok(12));
        assert_eq!(parse_device("0"), Ok(0));
        assert_eq!(parse_device("/dev/zram-uzram/ublkb2"), Ok(2));
        assert_eq!(parse_device("1048575"), Ok(1_048_575));
        for bad in [
            "1048576",
            "4294967295",
            "/dev/zram-uzram/ublkb",
            "",
            "/dev/ublkb",
            "ublkc3",
            "/dev/sda",
            "-1",
            "x1",
            "99999999999",
            "/dev/ublkb01",
            "ublkb007",
            "00",
        ] {
            assert!(parse_device(bad).is_err(), "{bad}");
        }
    }
}
