//! Byte sizes as people type them (`8G`, `512M`, `4096`) and as zramctl prints them (`8G`, `1.2M`).

use uzram_core::PAGE_SIZE;

/// The largest device or memory limit uzram accepts: 16 TiB. Anything above is a typo.
pub const MAX_SIZE: u64 = 16 << 40;

/// Why a size string was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    /// Not a number with an optional K/M/G/T suffix.
    #[error(
        "invalid size {0:?}: expected a number with an optional K, M, G or T suffix (e.g. 8G)"
    )]
    Syntax(String),
    /// The size is zero (or rounds to zero pages).
    #[error("size {0:?} is zero: give at least one 4096-byte page")]
    Zero(String),
    /// The size is larger than [`MAX_SIZE`].
    #[error("size {0:?} is larger than the 16T maximum")]
    TooLarge(String),
}

/// Parses `N`, `N[KMGT]`, `N[KMGT]iB`, `N[KMGT]B` (binary multiples, case-insensitive; a decimal
/// fraction like `1.5G` is allowed) and rounds up to whole 4096-byte pages.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let syntax = || SizeError::Syntax(text.to_string());
    let t = text.trim();
    let digits_end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(digits_end);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return Err(syntax());
    }
    let shift = match suffix.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(syntax()),
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if frac.contains('.') || frac.len() > 9 {
        return Err(syntax());
    }
    let whole: u64 = whole.parse().map_err(|_| syntax())?;
    let too_large = || SizeError::TooLarge(text.to_string());
    let mut bytes = whole
        .checked_mul(1u64 << shift)
        .filter(|b| *b <= MAX_SIZE)
        .ok_or_else(too_large)?;
    if !frac.is_empty() {
        let frac_num: u64 = frac.parse().map_err(|_| syntax())?;
        let denom = 10u64.pow(frac.len() as u32);
        // frac_num < denom <= 1e9 and the multiplier <= 2^40, so this fits in u128.
        let part = (u128::from(frac_num) << shift).div_ceil(u128::from(denom));
        bytes = bytes.saturating_add(u64::try_from(part).unwrap_or(u64::MAX));
    }
    let page = PAGE_SIZE as u64;
    let rounded = bytes.div_ceil(page).saturating_mul(page);
    if rounded == 0 {
        return Err(SizeError::Zero(text.to_string()));
    }
    if rounded > MAX_SIZE {
        return Err(too_large());
    }
    Ok(rounded)
}

/// Formats bytes the way zramctl does: one letter, at most one decimal (`0B`, `4K`, `1.2M`, `8G`).
pub fn format_size(bytes: u64) -> String {
    const LETTERS: [char; 7] = ['B', 'K', 'M', 'G', 'T', 'P', 'E'];
    let mut exp = 0u32;
    while exp < 60 && bytes >= 1u64 << (exp + 10) {
        exp += 10;
    }
    let letter = LETTERS[(exp / 10) as usize];
    if exp == 0 {
        return format!("{bytes}{letter}");
    }
    let mut whole = bytes >> exp;
    let rest = bytes & ((1u64 << exp) - 1);
    // util-linux: the remainder in 1/1024ths of the unit, rounded to one decimal digit.
    let mut frac = ((rest >> (exp - 10)) + 50) / 100;
    if frac >= 10 {
        whole += 1;
        frac = 0;
    }
    if frac == 0 {
        format!("{whole}{letter}")
    } else {
        format!("{whole}.{frac}{letter}")
    }
}

/// Bytes shown as [`format_size`] shows them, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Human(pub u64);

impl std::fmt::Display for Human {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&format_size(self.0))
    }
}

/// `bytes` as a size [`parse_size`] reads back exactly: with the largest suffix that divides
/// it (`16G`, `1540M`, `4K`), for messages that propose a setting.
pub fn exact(bytes: u64) -> String {
    for (shift, letter) in [(40, 'T'), (30, 'G'), (20, 'M'), (10, 'K')] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{letter}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_suffixes_and_rounds_to_pages() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1"), Ok(4096));
        assert_eq!(parse_size("4097"), Ok(8192));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("8G"), Ok(8 << 30));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size(" 64M "), Ok(64 << 20));
        assert_eq!(parse_size("16T"), Ok(MAX_SIZE));
    }

    #[test]
    fn refuses_bad_sizes() {
        assert!(matches!(parse_size("0"), Err(SizeError::Zero(_))));
        assert!(matches!(parse_size("0G"), Err(SizeError::Zero(_))));
        assert!(matches!(parse_size("17T"), Err(SizeError::TooLarge(_))));
        assert!(matches!(
            parse_size("99999999999999999999"),
            Err(SizeError::Syntax(_))
        ));
        assert!(matches!(
            parse_size("18446744073709551615T"),
            Err(SizeError::TooLarge(_))
        ));
        for bad in ["", "G", "abc", "-1", "1X", "1.2.3G", ".5G", "5.G", "1 G x"] {
            assert!(
                matches!(parse_size(bad), Err(SizeError::Syntax(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn formats_like_zramctl() {
        assert_eq!(format_size(0), "0B");
        assert_eq!(format_size(1000), "1000B");
        assert_eq!(format_size(4096), "4K");
        assert_eq!(format_size(8 << 30), "8G");
        assert_eq!(format_size((1 << 20) + (1 << 20) / 5), "1.2M");
        // util-linux rounds the decimal up into the unit without changing the letter.
        assert_eq!(format_size((1 << 30) - 1), "1024M");
        assert_eq!(format_size(u64::MAX), "16E");
    }

    #[test]
    fn exact_sizes_read_back() {
        for bytes in [4096u64, 16 << 30, 1540 << 20, (3 << 40) + 4096, 12 << 10] {
            assert_eq!(
                parse_size(&exact(bytes)).unwrap(),
                bytes,
                "{}",
                exact(bytes)
            );
        }
        assert_eq!(exact(16 << 30), "16G");
        assert_eq!(Human(3 << 30).to_string(), "3G");
    }
}
