//! The image URL of a chat message (`image_url.url` in OpenAI's protocol) to bytes. Only inline
//! `data:image/png;base64,...` and `data:image/jpeg;base64,...` URLs are accepted: the runtime
//! fetches nothing over the network on a client's behalf, so an http(s) URL is refused with a
//! message that says so.

use base64::Engine as _;

use super::{Result, VisionError};

/// The payload of an image data URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataUrlImage {
    /// The declared media type, lowercased (`image/png` or `image/jpeg`).
    pub media_type: String,
    pub bytes: Vec<u8>,
}

/// Media types accepted in a data URL (`image/jpg` is a common misspelling clients send).
const MEDIA_TYPES: [&str; 3] = ["image/png", "image/jpeg", "image/jpg"];

/// Parses `data:<media type>[;<parameter>]*;base64,<data>` (RFC 2397) into the decoded bytes.
pub fn parse_data_url(url: &str) -> Result<DataUrlImage> {
    let url = url.trim();
    let Some((scheme, rest)) = url.split_once(':') else {
        return Err(VisionError::MalformedDataUrl {
            reason: "no URL scheme (expected `data:image/...;base64,...`)",
        });
    };
    let scheme = scheme.to_ascii_lowercase();
    match scheme.as_str() {
        "data" => {}
        "http" | "https" => return Err(VisionError::RemoteUrl { scheme }),
        _ => return Err(VisionError::UnsupportedScheme { scheme }),
    }
    let Some((header, data)) = rest.split_once(',') else {
        return Err(VisionError::MalformedDataUrl {
            reason: "no `,` between the media type and the data",
        });
    };
    let mut parts = header.split(';');
    let media_type = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
    let mut base64 = false;
    for parameter in parts {
        // `;base64` ends the header; other parameters (`charset=...`, `name=...`) are ignored.
        base64 = parameter.trim().eq_ignore_ascii_case("base64");
    }
    if !MEDIA_TYPES.contains(&media_type.as_str()) {
        return Err(VisionError::UnsupportedMediaType { media_type });
    }
    if !base64 {
        return Err(VisionError::MalformedDataUrl {
            reason: "image data must be base64-encoded (`;base64,`)",
        });
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(VisionError::Base64)?;
    let media_type = if media_type == "image/jpg" {
        "image/jpeg".to_string()
    } else {
        media_type
    };
    Ok(DataUrlImage { media_type, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_png_data_url_decodes_to_its_bytes() {
        let image = parse_data_url("data:image/png;base64,iVBORw0KGgo=").unwrap();
        assert_eq!(image.media_type, "image/png");
        assert_eq!(image.bytes, b"\x89PNG\r\n\x1a\n");
    }

    #[test]
    fn media_type_and_base64_marker_are_case_insensitive_and_jpg_means_jpeg() {
        let image = parse_data_url("DATA:Image/JPG;BASE64,/9j/").unwrap();
        assert_eq!(image.media_type, "image/jpeg");
        assert_eq!(image.bytes, [0xff, 0xd8, 0xff]);
        let with_name = parse_data_url("data:image/png;name=x.png;base64,AAEC").unwrap();
        assert_eq!(with_name.bytes, [0, 1, 2]);
    }

    #[test]
    fn http_urls_are_refused_saying_they_are_not_fetched() {
        for url in ["http://example.com/cat.png", "HTTPS://example.com/cat.png"] {
            let err = parse_data_url(url).unwrap_err();
            assert!(matches!(err, VisionError::RemoteUrl { .. }), "{err}");
            assert!(err.to_string().contains("not fetched"), "{err}");
        }
    }

    #[test]
    fn other_schemes_and_malformed_urls_are_refused_with_the_reason() {
        let err = parse_data_url("file:///etc/passwd").unwrap_err();
        assert!(
            matches!(&err, VisionError::UnsupportedScheme { scheme } if scheme == "file"),
            "{err}"
        );
        let err = parse_data_url("no scheme at all").unwrap_err();
        assert!(matches!(err, VisionError::MalformedDataUrl { .. }), "{err}");
        let err = parse_data_url("data:image/png;base64").unwrap_err();
        assert!(err.to_string().contains("`,`"), "{err}");
        let err = parse_data_url("data:image/png,rawbytes").unwrap_err();
        assert!(err.to_string().contains("base64"), "{err}");
        let err = parse_data_url("data:image/webp;base64,AAAA").unwrap_err();
        let VisionError::UnsupportedMediaType { media_type } = &err else {
            panic!("{err}");
        };
        assert_eq!(media_type, "image/webp");
        let err = parse_data_url("data:image/png;base64,not base64!").unwrap_err();
        assert!(matches!(err, VisionError::Base64(_)), "{err}");
    }
}
