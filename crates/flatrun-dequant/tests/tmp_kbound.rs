use flatrun_dequant::*;
#[test]
fn measure() {
    let mut s = 1u64;
    for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        let mut worst = 0f32;
        for _ in 0..2000 {
            let x: Vec<f32> = (0..256).map(|_| { s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); ((s >> 40) as f32 / 16777216.0 * 2.0 - 1.0) * if (s>>20)%7==0 {8.0} else {1.0} }).collect();
            let y = dequantize_to_vec(ty, &quantize_to_vec(ty, &x).unwrap()).unwrap();
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (a, b) in x.iter().zip(&y) { worst = worst.max((a - b).abs() / amax); }
        }
        println!("{ty}: worst err/amax {worst}");
    }
}
