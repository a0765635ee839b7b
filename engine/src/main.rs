fn main() {
    let mut s = unsafe { mlx_sys::mlx_string_new() };
    unsafe { mlx_sys::mlx_version(&mut s) };
    let v = unsafe { std::ffi::CStr::from_ptr(mlx_sys::mlx_string_data(s)) };
    println!("{:?}", v);
    let a = mlx_rs::Array::from_slice(&[1.0f32, 2.0], &[2]);
    let b = mlx_rs::ops::multiply(&a, &a).unwrap();
    println!("{:?}", b.as_slice::<f32>());
}
