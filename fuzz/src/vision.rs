//! Images in chat messages: a client's PNG or JPEG bytes (or its data URL) decoded and
//! preprocessed as the engine and the trainer do (docs/vision.md).

use moult_runtime::vision::{
    image_placeholder_tokens, parse_data_url, placeholder_tokens_of, preprocess_bytes,
    ImageProcessorConfig,
};

/// Any bytes either fail with an error or give patches of the declared shape with finite
/// values, and the prompt reserves exactly the placeholder tokens the model will fill.
pub fn preprocess(data: &[u8]) {
    let config = ImageProcessorConfig::default();
    let Ok(image) = preprocess_bytes(data, &config) else {
        assert!(placeholder_tokens_of(data, &config).is_err() || data.is_empty());
        return;
    };
    let rows = image.rows();
    assert_eq!(
        rows,
        image
            .grid_thw
            .iter()
            .map(|&d| d as usize)
            .product::<usize>()
    );
    assert_eq!(image.patch_dim, config.patch_dim());
    assert_eq!(image.pixel_values.len(), rows * image.patch_dim);
    assert!(image.pixel_values.iter().all(|v| v.is_finite()));
    let tokens = placeholder_tokens_of(data, &config).expect("decoded once already");
    assert_eq!(
        tokens,
        image_placeholder_tokens(image.grid_thw, config.merge_size)
    );
    assert!(tokens > 0);
}

/// A data URL is refused or gives an accepted media type and its bytes.
pub fn data_url(data: &[u8]) {
    let Some(url) = crate::text(data) else {
        return;
    };
    if let Ok(image) = parse_data_url(url) {
        assert!(["image/png", "image/jpeg", "image/jpg"].contains(&image.media_type.as_str()));
    }
}
