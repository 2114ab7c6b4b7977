export PYTHONPATH=$PWD MAX_JOBS=16
python -c "from qerl.kernels import cuda_fp4 as cf; assert cf.available()" 
SECS="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,dram__sectors_read.sum --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
timeout 200 ncu $SECS --kernel-name regex:fp4_gemv_kernel --launch-skip 6 --launch-count 1 python .old/ncu_gemv.py 8 "gate|up" > $OUT/ncu_gateup_plain.txt 2>&1
timeout 200 ncu $SECS --kernel-name regex:fp4_gemv_kernel --launch-skip 6 --launch-count 1 python .old/ncu_gemv.py 8 down > $OUT/ncu_down_plain.txt 2>&1
timeout 200 ncu $SECS --kernel-name regex:fp4_gemv_lora_kernel --launch-skip 6 --launch-count 1 python .old/ncu_gemv.py 8 "gate|up" > $OUT/ncu_gateup_lora.txt 2>&1
grep -E "config|Duration|DRAM Throughput|Memory Throughput|L2 Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Block Limit|Waves Per SM|Grid Size|Block Size|Mem Busy|Max Bandwidth|Executed Ipc A|Stall|One or More|stalled|dram__" $OUT/ncu_gateup_plain.txt | head -60
echo ======== down
grep -E "Duration|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Waves Per SM|Grid Size|Block Size|long_scoreboard|lg_throttle|wait|math|not_selected|dram__" $OUT/ncu_down_plain.txt | head -20
echo ======== lora
grep -E "Duration|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Waves Per SM|Grid Size|Block Size|long_scoreboard|lg_throttle|wait|math|not_selected|dram__" $OUT/ncu_gateup_lora.txt | head -20
